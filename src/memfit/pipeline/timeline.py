"""The step of a schedule with several stages per rank, simulated on the order torch runs.

GPipe and 1F1B take ``(M - 1) x slowest stage + sum of stages`` (``balancing.pipeline_step_time``).
The schedules with several stages per rank have no such closed form once stages differ, so their
step is simulated: every rank runs its actions in torch's order (``rank_model.rank_actions``),
each as soon as the rank is free and what it needs is done, a forward after the previous stage's
forward of the same micro-batch, a backward after the next stage's backward (the last stage's
after its own forward). A backward or input-gradient step takes the stage's whole backward
(memfit's is one piece, NOTE [Zero-bubble schedules and memfit's one-piece backward]) and a
weight-gradient step none. Transfers take no time beyond what the stage times include.
"""

from __future__ import annotations

from collections.abc import Sequence

from memfit.pipeline.rank_model import rank_actions
from memfit.pipeline.schedule import PipelineSchedule

__all__ = ["simulate_step"]


def simulate_step(
    schedule: PipelineSchedule | str,
    ranks: int,
    stages_per_rank: int,
    microbatches: int,
    forward: Sequence[float],
    backward: Sequence[float],
) -> tuple[float, float]:
    """The step's seconds and its bubble (the idle share of the ranks' time), given each stage's
    ``forward`` and ``backward`` seconds per micro-batch, by stage index."""
    total = ranks * stages_per_rank
    queues = [rank_actions(schedule, ranks, stages_per_rank, microbatches, r) for r in range(ranks)]
    position = [0] * ranks
    free = [0.0] * ranks
    done: dict[tuple[str, int, int], float] = {}

    def needs(kind: str, stage: int, mb: int) -> tuple[str, int, int] | None:
        if kind == "F":
            return None if stage == 0 else ("F", stage - 1, mb)
        if kind == "W":
            return ("B", stage, mb)
        return ("F", stage, mb) if stage == total - 1 else ("B", stage + 1, mb)

    remaining = sum(len(q) for q in queues)
    while remaining:
        progressed = False
        for r in range(ranks):
            while position[r] < len(queues[r]):
                kind, stage, mb = queues[r][position[r]]
                need = needs(kind, stage, mb)
                if need is not None and need not in done:
                    break
                start = max(free[r], done[need] if need is not None else 0.0)
                seconds = {"F": forward[stage], "W": 0.0}.get(kind, backward[stage])
                free[r] = start + seconds
                # an input-gradient step is the backward the next ones wait for
                done[("B" if kind == "I" else kind, stage, mb)] = free[r]
                position[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"{schedule}'s order on {ranks} ranks does not progress")
    step = max(free)
    busy = microbatches * (sum(forward) + sum(backward))
    bubble = max(0.0, 1.0 - busy / (ranks * step)) if step > 0 else 0.0
    return step, bubble
