"""The step of a pipeline schedule, simulated on the order torch runs its actions in.

GPipe and 1F1B with equal stages take ``(M - 1) x slowest stage + sum of stages``
(``balancing.pipeline_step_time``); the schedules with several stages per rank have no such
closed form once stages differ, so their step is simulated, and GPipe's and 1F1B's can be too:
every rank runs its actions in torch's order (``rank_model.rank_steps``), each as soon as the
rank is free and what it needs is done, a forward after the previous stage's forward of the same
micro-batch, a backward after the next stage's backward (the last stage's after its own
forward). A backward or input-gradient step takes the stage's whole backward (memfit's is one
piece, NOTE [Zero-bubble schedules and memfit's one-piece backward]) and a weight-gradient step
none.

NOTE [What a step costs beyond its stages' times]
Measured on stages that sleep their time (``benchmarks/pipeline_schedules.py``), three things
the stage times leave out lengthen the step, and the simulation counts each as a mechanism:
* ``overhead``: every forward and backward costs the schedule runtime's own work beside the
  stage's compute (torch's bookkeeping per action, posting and waiting its sends and receives,
  the stage's wrapper). It is measured on the same pipeline with stages that take no time, one
  micro-batch (one rank works at a time), and is the same for every schedule: 1.4-2.7 ms on the
  2-core CPU over gloo, so a schedule with more stages per rank or more micro-batches pays it
  more often.
* ``latency``: a value another rank made reaches this one that much after it is done (over gloo
  on one host, a message's round trip through the transport: 0.12 ms).
* DualPipeV's overlapped pairs: torch runs the pair's forward and backward one after the other
  and posts the pair's sends only when both are done (``_add_send_recv`` puts them after the
  pair), so the forward's output leaves a backward's time late. This one needs no input.
Weight-gradient steps are empty in memfit and cost no overhead. With all three, the seven
schedules and ``auto``'s choice measured within 6.1% of the simulation (26% without them). Not
modelled: ranks that share fewer cores than they are (4 ranks on 2 cores) contend for them when
actions are short, which put 2 ms stages up to 38% above.
"""

from __future__ import annotations

from collections.abc import Sequence

from memfit.pipeline.placement import stage_ranks
from memfit.pipeline.rank_model import Action, rank_steps
from memfit.pipeline.schedule import PipelineSchedule

__all__ = ["simulate_step"]


def simulate_step(
    schedule: PipelineSchedule | str,
    ranks: int,
    stages_per_rank: int,
    microbatches: int,
    forward: Sequence[float],
    backward: Sequence[float],
    *,
    overhead: float = 0.0,
    latency: float = 0.0,
) -> tuple[float, float]:
    """The step's seconds and its bubble (the idle share of the ranks' time), given each stage's
    ``forward`` and ``backward`` seconds per micro-batch, by stage index.

    ``overhead``: seconds every forward and backward takes beyond its stage's time; ``latency``:
    seconds a value takes from one rank to another (NOTE [What a step costs beyond its stages'
    times]). The bubble is measured against the stages' own times, so the overhead counts as
    idle.
    """
    total = ranks * stages_per_rank
    placed = stage_ranks(schedule, ranks, stages_per_rank)
    queues = [rank_steps(schedule, ranks, stages_per_rank, microbatches, r) for r in range(ranks)]
    position = [0] * ranks
    free = [0.0] * ranks
    done: dict[Action, float] = {}

    def needs(kind: str, stage: int, mb: int) -> Action | None:
        if kind == "F":
            return None if stage == 0 else ("F", stage - 1, mb)
        if kind == "W":
            return ("B", stage, mb)
        return ("F", stage, mb) if stage == total - 1 else ("B", stage + 1, mb)

    def seconds(kind: str, stage: int) -> float:
        if kind == "W":
            return 0.0
        return (forward[stage] if kind == "F" else backward[stage]) + overhead

    remaining = sum(len(q) for q in queues)  # steps
    while remaining:
        progressed = False
        for r in range(ranks):
            while position[r] < len(queues[r]):
                step = queues[r][position[r]]
                ready = []
                for kind, stage, mb in step:
                    need = needs(kind, stage, mb)
                    if need is None:
                        ready.append(0.0)
                    elif need in done:
                        ready.append(done[need] + (latency if placed[need[1]] != r else 0.0))
                    elif any(need == (k if k != "I" else "B", s, m) for k, s, m in step):
                        ready.append(-1.0)  # made earlier in this same pair
                    else:
                        break
                else:
                    clock = free[r]
                    for (kind, stage, _), at in zip(step, ready):
                        clock = max(clock, at) + seconds(kind, stage)
                    free[r] = clock
                    # a pair's sends are posted when both its actions are done
                    for kind, stage, mb in step:
                        # an input-gradient step is the backward the next ones wait for
                        done[("B" if kind == "I" else kind, stage, mb)] = clock
                    position[r] += 1
                    remaining -= 1
                    progressed = True
                    continue
                break
        if not progressed:
            raise RuntimeError(f"{schedule}'s order on {ranks} ranks does not progress")
    step_s = max(free)
    busy = microbatches * (sum(forward) + sum(backward))
    bubble = max(0.0, 1.0 - busy / (ranks * step_s)) if step_s > 0 else 0.0
    return step_s, bubble
