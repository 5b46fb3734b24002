"""``memfit.pipeline.timeline``: a step simulated on the order torch runs the stages in."""

from __future__ import annotations

import pytest

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
