"""``memfit.pipeline.rank_model``: the order a rank runs its stages in, and what it holds."""

from __future__ import annotations

import dataclasses

from memfit.pipeline.rank_model import StageSizes, rank_actions, rank_step_peak, rank_steps
from memfit.pipeline.schedule import step_peak


def test_the_order_is_torchs() -> None:
    # looped BFS: every micro-batch through the earlier stage first, backwards in reverse
    assert rank_actions("looped_bfs", 2, 2, 2, 0) == [
        ("F", 0, 0), ("F", 0, 1), ("F", 2, 0), ("F", 2, 1),
        ("B", 2, 1), ("B", 2, 0), ("B", 0, 1), ("B", 0, 0),
    ]  # fmt: skip
    assert rank_actions("interleaved_1f1b", 2, 2, 2, 1) == [
        ("F", 1, 0), ("F", 1, 1), ("F", 3, 0), ("B", 3, 0),
        ("F", 3, 1), ("B", 3, 1), ("B", 1, 0), ("B", 1, 1),
    ]  # fmt: skip
    # ZBV: split backwards, the weight steps deferred; DualPipeV's overlapped pairs unpacked
    zbv = rank_actions("zbv_zero_bubble", 2, 2, 3, 1)
    assert zbv[:6] == [("F", 1, 0), ("F", 2, 0), ("F", 1, 1), ("F", 2, 1), ("I", 2, 0), ("W", 2, 0)]
    assert sorted(k for k, _, _ in zbv) == ["F"] * 6 + ["I"] * 6 + ["W"] * 6
    dual = rank_actions("dualpipev", 2, 2, 4, 1)
    assert sorted((s, m) for k, s, m in dual if k == "F") == [
        (s, m) for s in (1, 2) for m in range(4)
    ]


def test_a_rank_holds_its_stages_in_flight_its_gradients_and_every_pending_send() -> None:
    a = StageSizes(each=10, transient=7, grads=3, sent=4, input_grad=1)
    b = StageSizes(each=20, transient=9, grads=5, sent=6, input_grad=2)
    # looped BFS, rank 0 holds stages 0 and 2: B(2,1) runs beside 2 micro-batches of stage 0
    # and one of stage 2 in flight, nothing sent back yet: 40 + 9
    assert rank_step_peak("looped_bfs", 2, 2, 2, 0, {0: a, 2: b}) == 49
    # ZBV, rank 1 holds stages 1 and 2, which meet at the turn: stage 1's outputs are handed
    # over (each in flight holds 10 - 4), stage 2's input gradients too (never held, but each
    # replaces the previous step's in stage 1's buffer only once stage 2's backward is over:
    # 2 more during it). The peak, I(2,1), runs beside (1,1), (1,2) and (2,2) in flight
    # (6 + 6 + 20), both stages' gradients (8), stage 2's output of micro-batch 0 sent (6),
    # stage 1's input gradient of micro-batch 0 sent (1) and the gradient it replaces (2)
    assert rank_step_peak("zbv_zero_bubble", 2, 2, 3, 1, {1: a, 2: b}) == 32 + 9 + 8 + 7 + 2


def test_gpipe_and_1f1b_orders_and_dualpipevs_pairs() -> None:
    assert rank_actions("gpipe", 2, 1, 2, 1) == [("F", 1, 0), ("F", 1, 1), ("B", 1, 0), ("B", 1, 1)]
    # 1F1B on stage 0 of 2: two warm-up forwards, then one backward and one forward
    assert rank_actions("1f1b", 2, 1, 3, 0) == [
        ("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("F", 0, 2), ("B", 0, 1), ("B", 0, 2),
    ]  # fmt: skip
    steps = rank_steps("dualpipev", 2, 2, 4, 0)
    assert (("F", 0, 3), ("B", 3, 1)) in steps  # a forward overlapped with a backward
    assert [a for s in steps for a in s] == rank_actions("dualpipev", 2, 2, 4, 0)


def test_one_stage_per_rank_takes_the_schedules_formula() -> None:
    part = StageSizes(each=10, transient=7, grads=3, sent=4, input_grad=1)
    for schedule in ("gpipe", "1f1b"):
        expected = step_peak(schedule, 1, 4, 6, **dataclasses.asdict(part))
        assert rank_step_peak(schedule, 4, 1, 6, 1, {1: part}) == expected
