"""memfit's planner on a pipeline's stages: each stage's frontier, and the points a rank keeps.

Each stage's graph is planned by memfit's planner, which gives its Pareto frontier of peak
against added time: recomputation and, with ``offload``, the time compute waits for the link
(offloaded values leave the device while the micro-batch waits for its backward, which is how
the activations of micro-batches in flight are offloaded). What a rank holds depends on all its
stages together (the schedule runs their micro-batches interleaved), so a rank's stages choose
their points together: the least added time, summed over the rank's stages, whose predicted rank
peak (``rank_model.rank_step_peak``, with the other micro-batches in flight as the schedule has
them) fits the per-device budget.

With one stage per rank (GPipe, 1F1B) that is exactly the cheapest point that fits. With
several, every combination of the stages' points is tried while there are at most
``EXHAUSTIVE`` (the rank peak is simulated on the schedule's order for each); beyond that the
rank starts from every stage's cheapest point and, while over the budget, moves the stage whose
next smaller point saves the most bytes of the rank's peak per second added (greedy: up to 1.8x
the least added time on TinyGPT's DualPipeV rank, where every combination is tried). Without a
budget every stage keeps everything.

The chosen point is a search's; the plan ``memfit.checkpoint(stage, point's peak)`` makes is
what runs (it may keep less), so each stage is planned again at that peak and its numbers are the
prediction (``exact``; ``schedule="auto"`` compares candidates on the points' own numbers and
plans only its choice again: a plan captures the stage anew, seconds each). Both plans are cached
on the ``Search`` by span: ``auto`` plans the same span under many schedules.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from memfit.execution.module import plan as memfit_plan
from memfit.execution.options import Options
from memfit.pipeline.costs import Search, state_bytes
from memfit.pipeline.partition import StageGraph
from memfit.pipeline.pipeline_options import Configuration
from memfit.pipeline.placement import stage_ranks
from memfit.pipeline.schedule import in_flight
from memfit.pipeline.stages import StagePlan, rank_peak
from memfit.planning.budget import BudgetError
from memfit.planning.plan import FrontierPoint, Plan
from memfit.units import format_bytes

__all__ = [
    "EXHAUSTIVE",
    "StageFacts",
    "StageRefused",
    "plan_rank",
    "predicted_rank_peak",
    "stage_facts",
]

#: a rank's stages try every combination of their frontier points up to this many
EXHAUSTIVE = 512


class StageRefused(Exception):
    """A rank's stages do not fit the budget; ``stage`` is the one to cut differently (the
    largest at its least), ``error`` says why."""

    def __init__(self, stage: int, error: BudgetError) -> None:
        super().__init__(str(error))
        self.stage, self.error = stage, error


@dataclass(frozen=True)
class StageFacts:
    """What planning one stage reads: its graph and example inputs, the bytes it holds and
    passes on, and memfit's frontier for its graph (one micro-batch)."""

    graph: StageGraph
    inputs: tuple[torch.Tensor, ...]
    parameter_bytes: int
    buffer_bytes: int
    optimizer_bytes: int
    send_bytes: int
    receive_bytes: int
    receive_grad_bytes: int
    is_last: bool
    frontier: tuple[FrontierPoint, ...]
    #: the stage's forward FLOPs (one micro-batch), against which recomputation is a share
    forward_flops: int


def _memfit_plan(
    search: Search,
    stage: StageGraph,
    inputs: tuple[torch.Tensor, ...],
    policy: float | int,
    config: Configuration,
    attention: str,
) -> Plan:
    """memfit's plan of ``stage`` at ``policy``, cached on ``search`` by span."""
    key = (stage.start, stage.end, policy, config.offload, attention)
    if key not in search.stage_plans:
        search.stage_plans[key] = memfit_plan(
            stage.module,
            *inputs,
            policy=policy,
            offload=config.offload,
            options=Options(attention=attention, measure_outside=False),
        )
    return search.stage_plans[key]


def stage_facts(
    search: Search,
    stage: StageGraph,
    inputs: tuple[torch.Tensor, ...],
    config: Configuration,
    *,
    attention: str = "auto",
) -> StageFacts:
    """``stage``'s facts (``StageFacts``), its frontier planned by memfit (cached by span)."""
    params, buffers, opt = state_bytes(search, set(stage.state_names), config.optimizer_state)
    last = stage.end == len(search.captured.nodes)
    planned = _memfit_plan(search, stage, inputs, 1.0, config, attention)
    return StageFacts(
        graph=stage,
        inputs=inputs,
        parameter_bytes=params,
        buffer_bytes=buffers,
        optimizer_bytes=opt,
        send_bytes=search.output_bytes if last else stage.send_bytes,
        receive_bytes=stage.receive_bytes if stage.index > 0 else 0,
        receive_grad_bytes=stage.receive_grad_bytes if stage.index > 0 else 0,
        is_last=last,
        frontier=tuple(planned.pareto()),
        forward_flops=planned.forward_flops,
    )


def _cheapest(points: Sequence[FrontierPoint]) -> FrontierPoint:
    return min(points, key=lambda p: (p.cost_seconds, p.recompute_flops, p.peak_bytes))


def _choose(
    facts: Sequence[StageFacts],
    peak_of: Callable[[Sequence[FrontierPoint]], int],
    budget: int | None,
) -> tuple[list[FrontierPoint] | None, int]:
    """The points the rank's stages keep (None when none fit) and the least peak seen."""
    fastest = [_cheapest(f.frontier) for f in facts]
    if budget is None:
        return fastest, peak_of(fastest)
    if math.prod(len(f.frontier) for f in facts) <= EXHAUSTIVE:
        combos = {c: peak_of(c) for c in itertools.product(*(f.frontier for f in facts))}
        fitting = [c for c, peak in combos.items() if peak <= budget]
        if not fitting:
            return None, min(combos.values())
        best = min(fitting, key=lambda c: (sum(p.cost_seconds for p in c), combos[c]))
        return list(best), combos[best]
    # frontiers by increasing peak: a smaller point is one step to the left
    at = [f.frontier.index(p) for f, p in zip(facts, fastest)]
    points = list(fastest)
    peak = least = peak_of(points)
    while peak > budget:
        moves = []
        for k, f in enumerate(facts):
            if at[k] == 0:
                continue
            trial = [*points[:k], f.frontier[at[k] - 1], *points[k + 1 :]]
            added = max(trial[k].cost_seconds - points[k].cost_seconds, 1e-12)
            trial_peak = peak_of(trial)
            moves.append(((peak - trial_peak) / added, -added, k, trial, trial_peak))
        if not moves:
            return None, least
        _, _, k, points, peak = max(moves, key=lambda m: (m[0], m[1]))
        at[k] -= 1
        least = min(least, peak)
    return points, least


def _rank_of(facts: Sequence[StageFacts], config: Configuration) -> int:
    return stage_ranks(config.schedule, config.ranks, config.stages_per_rank)[facts[0].graph.index]


def predicted_rank_peak(
    search: Search,
    facts: Sequence[StageFacts],
    points: Sequence[FrontierPoint],
    config: Configuration,
) -> int:
    """The peak of the rank holding ``facts`` (all its stages) were each to keep its point of
    ``points``: the ``StagePlan`` each point makes, and that rank's ``stages.rank_peak``, so the
    search and the plans it returns are one model."""
    rank = _rank_of(facts, config)
    plans = [
        _stage_plan(search, f, p, config, rank, "auto", exact=False) for f, p in zip(facts, points)
    ]
    return rank_peak(plans, config.ranks)


def plan_rank(
    search: Search,
    facts: Sequence[StageFacts],
    config: Configuration,
    *,
    attention: str = "auto",
    exact: bool = True,
) -> dict[int, StagePlan]:
    """Plans of one rank's stages (``facts``, all of them), chosen together; see the module
    docstring (``exact``: each planned again at its point's peak, what runs; else the point's
    own numbers). Raises ``StageRefused`` when they cannot fit the per-device budget."""
    rank = _rank_of(facts, config)

    def peak_of(points: Sequence[FrontierPoint]) -> int:
        return predicted_rank_peak(search, facts, points, config)

    points, least = _choose(facts, peak_of, config.budget)
    if points is None:

        def at_least(f: StageFacts) -> int:  # what the stage holds with its smallest point
            p = min(f.frontier, key=lambda q: q.peak_bytes)
            return _stage_plan(search, f, p, config, rank, attention, exact=False).peak_bytes

        largest = max(facts, key=at_least)
        where = ", ".join(
            f"stage {f.graph.index} ({f.graph.modules[0] if f.graph.modules else '?'} ..)"
            for f in facts
        )
        raise StageRefused(
            largest.graph.index,
            BudgetError(
                f"rank {rank}'s {where} do not fit {format_bytes(config.budget or 0)}: its "
                f"least predicted peak with memfit's plans is {format_bytes(least)}"
                if len(facts) > 1
                else f"{where} does not fit {format_bytes(config.budget or 0)}: its least "
                f"predicted peak with memfit's plan is {format_bytes(least)}",
                budget_bytes=config.budget,
                least_bytes=least,
            ),
        )
    return {
        f.graph.index: _stage_plan(search, f, p, config, rank, attention, exact)
        for f, p in zip(facts, points)
    }


def _stage_plan(
    search: Search,
    facts: StageFacts,
    point: FrontierPoint,
    config: Configuration,
    rank: int,
    attention: str,
    exact: bool,
) -> StagePlan:
    stage = facts.graph
    if exact:
        chosen = _memfit_plan(search, stage, facts.inputs, point.peak_bytes, config, attention)
        kept, transient, offloaded = (
            chosen.kept_bytes,
            chosen.predicted_peak_bytes,
            chosen.offloaded_bytes,
        )
        recompute, stall = chosen.recompute_flops, chosen.stall_seconds
    else:
        kept, transient, offloaded = point.kept_bytes, point.peak_bytes, point.offloaded_bytes
        recompute, stall = point.recompute_flops, point.stall_seconds
    costs = search.costs
    first_item = costs.boundaries.index(stage.start)
    last_item = costs.boundaries.index(stage.end)
    forward = sum(costs.forward_seconds[first_item:last_item])
    ratio = recompute / facts.forward_flops if facts.forward_flops else 0.0
    bandwidth = config.bandwidth
    last = facts.is_last
    return StagePlan(
        index=stage.index,
        stages=config.stages,
        start=stage.start,
        end=stage.end,
        modules=tuple(stage.modules),
        parameter_bytes=facts.parameter_bytes,
        buffer_bytes=facts.buffer_bytes,
        optimizer_bytes=facts.optimizer_bytes,
        receive_bytes=facts.receive_bytes,
        send_bytes=facts.send_bytes,
        receive_grad_bytes=facts.receive_grad_bytes,
        in_flight=in_flight(config.schedule, stage.index, config.stages, config.microbatches),
        microbatches=config.microbatches,
        kept_bytes=kept,
        transient_bytes=transient,
        forward_seconds=forward,
        recompute_seconds=ratio * forward,
        transfer_seconds=2 * facts.send_bytes / bandwidth if bandwidth and not last else 0.0,
        budget_bytes=point.peak_bytes,
        is_last=last,
        schedule=config.schedule,
        rank=rank,
        offloaded_bytes=offloaded,
        stall_seconds=stall,
    )
