"""What a rank that runs several stages holds during a step, from the order torch runs them in.

The schedules with several stages per rank (interleaved, looped, zero bubble, V) are run by torch's
``_PipelineScheduleRuntime`` from an action list per rank: forwards ``F``, backwards ``B`` (or input
``I`` then weight ``W`` gradients), and DualPipeV's overlapped pairs. Their memory does not follow a
formula as GPipe's and 1F1B's do (``schedule.held_at_backward``), so it is simulated on that list
(``rank_actions``, made by torch's own schedule classes over stand-in stages, so it is the order
that runs) by ``rank_step_peak``, which takes GPipe's and 1F1B's from their formula; NOTE [What
torch's runtime schedules hold] says what each action adds and frees. GPipe's and 1F1B's orders (one
stage per rank) are listed too, written out as their ``_step_microbatches`` run them, so that
``timeline`` can simulate every schedule's step alike.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Mapping
from dataclasses import dataclass

from torch.distributed.pipelining import (
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

from memfit.pipeline.placement import stage_ranks
from memfit.pipeline.schedule import PipelineSchedule, as_schedule, is_single, step_peak

__all__ = ["Action", "StageSizes", "rank_actions", "rank_step_peak", "rank_steps"]

_CLASSES = {
    PipelineSchedule.INTERLEAVED_1F1B: ScheduleInterleaved1F1B,
    PipelineSchedule.LOOPED_BFS: ScheduleLoopedBFS,
    PipelineSchedule.INTERLEAVED_ZERO_BUBBLE: ScheduleInterleavedZeroBubble,
    PipelineSchedule.ZBV_ZERO_BUBBLE: ScheduleZBVZeroBubble,
    PipelineSchedule.DUALPIPEV: ScheduleDualPipeV,
}

#: ``(kind, stage, micro-batch)``; kind ``"F"``, ``"B"``, ``"I"`` or ``"W"``
Action = tuple[str, int, int]


def rank_steps(
    schedule: PipelineSchedule | str, ranks: int, stages_per_rank: int, microbatches: int, rank: int
) -> list[tuple[Action, ...]]:
    """The compute steps rank ``rank`` runs in one step of the pipeline, in order (checked on
    torch 2.13): one action each, or DualPipeV's overlapped forward-backward pair, whose two
    actions run one after the other and whose sends are posted only when both are done
    (torch's ``_add_send_recv`` puts a pair's sends after the pair).

    GPipe runs every forward then every backward; 1F1B ``min(M, K - r)`` forwards, then one
    backward and one forward while forwards remain, then the backwards left. For the others,
    torch's schedule class computes every rank's order when it is made; it reads only the
    stages' index, count and group, so stand-ins carry those.
    """
    return list(_rank_steps(as_schedule(schedule), ranks, stages_per_rank, microbatches, rank))


@functools.lru_cache(maxsize=1024)
def _rank_steps(
    chosen: PipelineSchedule, ranks: int, stages_per_rank: int, microbatches: int, rank: int
) -> tuple[tuple[Action, ...], ...]:
    """``rank_steps``, kept: torch's schedule class takes about 1.5 ms to build an order, and a
    rank's stages are simulated on it once per combination of plans they try (``stage_planner``)
    and per configuration ``schedule="auto"`` compares."""
    m = microbatches
    if chosen is PipelineSchedule.GPIPE:
        gpipe: list[tuple[Action, ...]] = [(("F", rank, i),) for i in range(m)]
        return (*gpipe, *((("B", rank, i),) for i in range(m)))
    if chosen is PipelineSchedule.ONE_F_ONE_B:
        warmup = min(m, ranks - rank)
        order: list[tuple[Action, ...]] = [(("F", rank, i),) for i in range(warmup)]
        for j in range(m):
            order.append((("B", rank, j),))
            if j + warmup < m:
                order.append((("F", rank, j + warmup),))
        return tuple(order)
    total = ranks * stages_per_rank
    placed = stage_ranks(chosen, ranks, stages_per_rank)
    stand_ins = [
        types.SimpleNamespace(
            stage_index=s,
            num_stages=total,
            group_size=ranks,
            group_rank=rank,
            submod=None,
            is_first=s == 0,
            is_last=s == total - 1,
        )
        for s in range(total)
        if placed[s] == rank
    ]
    made = _CLASSES[chosen](stand_ins, microbatches, loss_fn=lambda output, target: output)
    out: list[tuple[Action, ...]] = []
    for action in made.pipeline_order[rank]:
        if action is None:
            continue
        step = tuple(
            (a.computation_type.value, a.stage_index, a.microbatch_index)
            for a in getattr(action, "sub_actions", None) or (action,)
            if a.computation_type.value in ("F", "B", "I", "W")
        )
        if step:
            out.append(step)
    return tuple(out)


def rank_actions(
    schedule: PipelineSchedule | str, ranks: int, stages_per_rank: int, microbatches: int, rank: int
) -> list[Action]:
    """The compute actions rank ``rank`` runs in one step, in order (``rank_steps`` with an
    overlapped pair listed as its two actions, in the pair's order)."""
    return [
        a for step in rank_steps(schedule, ranks, stages_per_rank, microbatches, rank) for a in step
    ]


@dataclass(frozen=True)
class StageSizes:
    """One stage's part in its rank's step (bytes; ``StagePlan`` has the same numbers)."""

    #: what each micro-batch in flight holds: what the plan keeps and the stage's outputs
    each: int
    #: one micro-batch's forward and backward, its parameter gradients included
    transient: int
    #: the parameters' gradients, alive from the stage's first backward on
    grads: int
    #: one micro-batch's outputs, as sent to the next stage
    sent: int
    #: one micro-batch's input gradients, as sent back to the previous stage
    input_grad: int


# NOTE [What torch's runtime schedules hold]
# Checked on torch 2.13, ``_PipelineScheduleRuntime._step_microbatches``: every send it starts
# (a stage's outputs after ``F``, its input gradients after ``B`` or ``I``) is appended to
# ``send_ops`` and waited for only when the step ends, and a pending send holds its tensor: so
# each micro-batch's outputs outlive its backward, and every input gradient sent stays, until the
# step ends. Between two stages on the same rank (the turn of a V) nothing is sent: the value is
# handed over (``set_local_fwd_input`` / ``set_local_bwd_input``), and it takes the place of the
# receiving stage's receive buffer for that micro-batch, which until then held the previous
# step's value (counted between steps, ``StagePlan.buffers_bytes``): so an output handed over
# frees as much as it takes, and is not counted again with its micro-batch in flight. The
# previous value goes only when the handing stage's action is over, though: during the backward
# of the stage after the turn, its new input gradient and the previous step's, still in the
# earlier stage's buffer, are both alive, one input gradient more than the net count (the
# forward's twin, an output beside the buffered one, lies below every backward's peak). Beside a
# backward the rank holds every other micro-batch in flight in any of its stages, the gradients
# of every stage that has run a backward, and what the sends hold. Zero-bubble stages run
# memfit's backward whole at ``I`` (NOTE [Zero-bubble schedules and memfit's one-piece
# backward]), so ``W`` frees and holds nothing more.
# Measured on an 8-layer MLP (2 ranks, 4 micro-batches, 64 KiB per activation, four
# two-layer stages), live bytes over each action of a step: every backward of the stage after
# the turn (stage 2) 74 KiB above the net count under ZBV and DualPipeV alike (the gradient, and
# about 10 KiB that every backward shows), which set ZBV's rank 1 peak 8.7% above the prediction
# (DualPipeV's peaks at stage 1, where the count held); with it, 1.1%.


def rank_step_peak(
    schedule: PipelineSchedule | str,
    ranks: int,
    stages_per_rank: int,
    microbatches: int,
    rank: int,
    sizes: Mapping[int, StageSizes],
) -> int:
    """Rank ``rank``'s peak during a step above what is live before it, its stages' parts
    ``sizes`` (all of them, by stage index): its one stage's under GPipe and 1F1B
    (``schedule.step_peak``), else the largest of its backwards, simulated on the order torch
    runs its stages in (NOTE [What torch's runtime schedules hold])."""
    if is_single(schedule):
        ((stage, part),) = sizes.items()
        return step_peak(schedule, stage, ranks, microbatches, **dataclasses.asdict(part))
    placed = stage_ranks(schedule, ranks, stages_per_rank)
    total = len(placed)
    flight: set[tuple[int, int]] = set()
    with_grads: set[int] = set()
    held = peak = 0

    def each(s: int) -> int:
        handed_over = s < total - 1 and placed[s + 1] == rank
        return sizes[s].each - (sizes[s].sent if handed_over else 0)

    for kind, stage, mb in rank_actions(schedule, ranks, stages_per_rank, microbatches, rank):
        if kind == "F":
            flight.add((stage, mb))
            continue
        if kind == "W":
            continue
        others = sum(each(s) for s, m in flight if (s, m) != (stage, mb))
        grads = sum(sizes[s].grads for s in with_grads)
        # after the turn, the previous step's gradient waits in the earlier stage's buffer
        replaced = sizes[stage].input_grad if stage > 0 and placed[stage - 1] == rank else 0
        peak = max(peak, others + sizes[stage].transient + grads + held + replaced)
        flight.discard((stage, mb))
        with_grads.add(stage)
        if stage < total - 1 and placed[stage + 1] != rank:
            held += sizes[stage].sent
        if stage > 0 and placed[stage - 1] != rank:
            held += sizes[stage].input_grad
    return peak
