"""``memfit.pipeline.timeline``: a step simulated on the order torch runs the stages in."""

from __future__ import annotations

import pytest

from memfit.pipeline import timeline
from memfit.pipeline.timeline import simulate_step


def test_looped_bfs_by_hand() -> None:
    # 2 ranks, stages 0 and 2 on rank 0, forward 1 s and backward 2 s each, 2 micro-batches:
    # the forwards end at 5 s (stage 3's second), then the backwards run down the pipe, each
    # waiting for the next stage's: rank 0's last, stage 0's micro-batch 0, ends at 15 s
    step, bubble = simulate_step("looped_bfs", 2, 2, 2, [1.0] * 4, [2.0] * 4)
    assert step == 15.0
    assert bubble == pytest.approx(1 - 24 / 30)


@pytest.mark.parametrize(("ranks", "chunks", "microbatches"), [(2, 2, 4), (4, 2, 8), (2, 3, 4)])
def test_interleaved_1f1b_takes_megatrons_step(ranks: int, chunks: int, microbatches: int) -> None:
    """Equal stages: the ideal ``M x V x (f + b)`` plus Megatron's interleaved bubble,
    ``(K - 1) x (f + b)`` of a whole rank's layers divided by ``V``, i.e. ``(K - 1) (f + b)``
    of one stage."""
    f, b = 1.0, 2.0
    total = ranks * chunks
    step, _ = simulate_step(
        "interleaved_1f1b", ranks, chunks, microbatches, [f] * total, [b] * total
    )
    assert step == pytest.approx(microbatches * chunks * (f + b) + (ranks - 1) * (f + b))


def test_every_schedule_is_no_slower_than_its_work_and_no_faster_than_gpipe_bounds() -> None:
    for schedule in ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble"):
        step, bubble = simulate_step(schedule, 4, 2, 8, [1.0] * 8, [2.0] * 8)
        assert 8 * 2 * 3 <= step < (8 + 4 - 1) * 2 * 3  # work <= step < GPipe on whole ranks
        assert 0 < bubble < 3 / 11
    for schedule in ("zbv_zero_bubble", "dualpipev"):
        step, _ = simulate_step(schedule, 2, 2, 4, [1.0] * 4, [2.0] * 4)
        assert 4 * 2 * 3 <= step < (4 + 2 - 1) * 2 * 3


def test_gpipe_and_1f1b_take_the_formula() -> None:
    """One stage per rank, backward twice the forward: ``(M - 1) max t + sum t``, as
    ``balancing.pipeline_step_time`` has it (GPipe's order reaches it for unequal stages too)."""
    forward = [1.0, 3.0, 2.0, 1.0]
    backward = [2 * f for f in forward]
    step, bubble = simulate_step("gpipe", 4, 1, 8, forward, backward)
    assert step == pytest.approx(7 * 9.0 + 21.0)
    assert bubble == pytest.approx(1 - 8 * 21.0 / (4 * 84.0))
    step, _ = simulate_step("1f1b", 4, 1, 8, [1.0] * 4, [2.0] * 4)
    assert step == pytest.approx(7 * 3.0 + 12.0)


def test_overhead_and_latency_lengthen_gpipe_as_a_pipe_of_longer_actions() -> None:
    # every action o longer: (M + K - 1)(f + b + 2o); every message l later: 2 (K - 1) l more,
    # once down the pipe and once back up
    f, b, o, lat = 1.0, 2.0, 0.25, 0.5
    step, _ = simulate_step("gpipe", 4, 1, 8, [f] * 4, [b] * 4, overhead=o)
    assert step == pytest.approx(11 * (f + b + 2 * o))
    step, bubble = simulate_step("gpipe", 4, 1, 8, [f] * 4, [b] * 4, latency=lat)
    assert step == pytest.approx(11 * (f + b) + 2 * 3 * lat)
    assert bubble == pytest.approx(1 - 8 * 3 / step)  # the bubble is against the stages' times


def test_an_overlapped_pair_sends_when_both_its_actions_are_done(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 0 runs F(0, 1) paired with B(0, 0), which waits for rank 1's B(1, 0): F(0, 1)'s
    output leaves when the pair ends, at 6 s, not when the forward does, at 2 s."""
    orders = {
        0: [(("F", 0, 0),), (("F", 0, 1), ("B", 0, 0)), (("B", 0, 1),)],
        1: [(("F", 1, 0),), (("B", 1, 0),), (("F", 1, 1),), (("B", 1, 1),)],
    }
    monkeypatch.setattr(timeline, "rank_steps", lambda s, k, v, m, r: orders[r])
    step, _ = simulate_step("gpipe", 2, 1, 2, [1.0, 1.0], [2.0, 2.0])
    # F(1, 1) runs from 6 to 7, B(1, 1) to 9, rank 0's B(0, 1) to 11 (9 if sent at once)
    assert step == 11.0


def test_dualpipev_pairs_cost_it_against_zbv_on_the_same_v() -> None:
    # the same V and stages: DualPipeV's pairs hold its forwards' outputs back
    dual, _ = simulate_step("dualpipev", 4, 2, 8, [1.0] * 8, [2.0] * 8)
    zbv, _ = simulate_step("zbv_zero_bubble", 4, 2, 8, [1.0] * 8, [2.0] * 8)
    assert dual > zbv
