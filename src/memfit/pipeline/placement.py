"""Which rank holds which stage, for a schedule that may run several stages per rank.

GPipe and 1F1B run stage ``s`` on rank ``s``. Interleaved and looped schedules cut the model into
``V x K`` stages and deal them out in turn, stage ``s`` on rank ``s % K``, so a micro-batch
passes every rank ``V`` times. V-shaped schedules (ZBV, DualPipeV) cut ``2K`` stages and fold
them: rank ``r`` holds stages ``r`` and ``2K - 1 - r``, so rank 0 holds the first stage and the
last, and the turn in the middle stays on rank ``K - 1``. These are torch's placements
(``torch.distributed.pipelining._utils.generate_stage_to_rank_mapping``, styles "loop" and "v",
checked on 2.13); they are restated here so plans made without a process group know them.
"""

from __future__ import annotations

from memfit.pipeline.schedule import PipelineSchedule, is_v_shaped

__all__ = ["local_stages", "stage_ranks"]


def stage_ranks(
    schedule: PipelineSchedule | str, ranks: int, stages_per_rank: int
) -> tuple[int, ...]:
    """The rank of every one of the ``ranks x stages_per_rank`` stages, by stage index."""
    total = ranks * stages_per_rank
    if not is_v_shaped(schedule):
        return tuple(s % ranks for s in range(total))
    # a V over each pair of rounds: down the ranks, then back up
    return tuple(
        s % ranks if (s // ranks) % 2 == 0 else ranks - 1 - s % ranks for s in range(total)
    )


def local_stages(
    schedule: PipelineSchedule | str, ranks: int, stages_per_rank: int, rank: int
) -> list[int]:
    """The stages rank ``rank`` holds, in increasing order."""
    placed = stage_ranks(schedule, ranks, stages_per_rank)
    return [s for s, r in enumerate(placed) if r == rank]
