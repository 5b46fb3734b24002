"""The cut search: where to cut a captured forward into K stages, checked by memfit's planner.

The cut is chosen exactly (``intervals.balance_intervals``) over the candidate cuts of the
captured forward (``partition.item_boundaries``) for the predicted step of the schedule,
``(M - 1) * slowest stage + sum of stages``, with every stage's predicted peak within the
per-device budget (``choose_cuts``). The stage model of that search is GPipe's: a stage keeps,
per micro-batch in flight, only what crosses its cuts and recomputes the rest in backward, so
while one micro-batch's backward runs it holds that micro-batch's activations (``costs``). Where
a rank holds ``V`` stages, the fastest split is proposed first, whatever the budget (the
planner, which simulates the rank, judges it); once a span is refused, each stage is held to
``budget / V`` (the rank's stages together then fit, by that model: a bound, since they do not
all peak at once, so it may refuse budgets a rank would meet).

That model is an estimate; memfit's planner, which decides what each stage really keeps, a
rank's stages together (``stage_planner.plan_rank``), may need more. A span it cannot fit within
the budget is refused and the search runs again without it, until a split whose every rank the
planner fits is found (``search_stages``, the one loop both ``plan`` and ``Pipeline`` run;
``Pipeline`` plugs in its ranks' agreement on the cuts and their refusals).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from memfit.pipeline.costs import TRAINING_FACTOR, Search, state_bytes
from memfit.pipeline.intervals import CapacityError, balance_intervals
from memfit.pipeline.partition import StageGraph, split_stages
from memfit.pipeline.pipeline_options import Configuration
from memfit.pipeline.placement import stage_ranks
from memfit.pipeline.schedule import step_peak
from memfit.pipeline.stage_planner import StageRefused, plan_rank, stage_facts
from memfit.pipeline.stages import PipelinePlan, StagePlan, stage_inputs
from memfit.planning.budget import BudgetError
from memfit.units import format_bytes

__all__ = [
    "MAX_REFUSALS",
    "Span",
    "StagesFound",
    "choose_cuts",
    "plan_from_search",
    "refuse",
    "search_stages",
]

#: A stage span memfit's planner refused: ``(stage index, first node, end node)``.
Span = tuple[int, int, int]


def choose_cuts(
    search: Search, config: Configuration, refused: frozenset[Span] = frozenset()
) -> list[int]:
    """Node positions of the ``stages - 1`` cuts minimising the predicted step (exact).

    ``refused``: spans memfit's planner could not fit in the budget although the search's model
    said they would; the search avoids them.
    """
    stages, microbatches, schedule = config.stages, config.microbatches, config.schedule
    budget, bandwidth = config.budget, config.bandwidth
    costs = search.costs
    n = costs.count
    if stages > n:
        raise ValueError(
            f"{stages} stages need {stages} pieces, but the model has only {n} between its "
            f"{n - 1} candidate cuts (module boundaries)"
        )
    bounds = costs.boundaries
    last = bounds[-1]
    fwd = list(itertools.accumulate(costs.forward_seconds, initial=0.0))
    act = list(itertools.accumulate(costs.activation_bytes, initial=0))

    def sent(j: int) -> int:
        return search.crossing[bounds[j]] if bounds[j] < last else search.output_bytes

    def received(i: int) -> int:
        return search.crossing[bounds[i]] if i > 0 else 0

    def stage_time(i: int, j: int) -> float:
        transfer = 2 * sent(j) / bandwidth if bandwidth and j < n else 0.0
        return TRAINING_FACTOR * (fwd[j] - fwd[i]) + transfer

    held, grads = _held_state(search, config.optimizer_state)
    over = float(budget or 0) + 1.0
    share = config.stages_per_rank  # each of a rank's stages within budget / V
    if share > 1 and not refused:
        # V x a stage's bound is far above what a rank's stages hold together (they do not all
        # peak at once): propose the fastest split first and let the planner judge the ranks
        budget = None

    def stage_memory(s: int, i: int, j: int) -> float:
        if (s, bounds[i], bounds[j]) in refused:
            return over
        # GPipe's stage: nothing kept but what crosses the cuts; one micro-batch's activations
        # (all recomputed) and its gradients while its backward runs
        transient = act[j] - act[i] + grads[i, j]
        return share * (
            held[i, j]
            + microbatches * (received(i) + (sent(j) if j < n else 0))
            + step_peak(
                schedule,
                s,
                stages,
                microbatches,
                each=sent(j),
                transient=transient,
                grads=grads[i, j],
                sent=sent(j),
                input_grad=received(i),
            )
        )

    try:
        sizes = balance_intervals(
            n,
            stages,
            microbatches=microbatches,
            stage_time=stage_time,
            stage_memory=stage_memory if budget is not None else None,
            capacity=budget,
        )
    except CapacityError as exc:
        raise _no_split_fits(stages, budget, len(refused), exc.least_capacity) from None
    return [bounds[pos] for pos in itertools.accumulate(sizes[:-1])]


def _held_state(
    search: Search, optimizer_state: float
) -> tuple[dict[tuple[int, int], int], dict[tuple[int, int], int]]:
    """What a stage over items ``[i, j)`` holds between steps (parameters, buffers, optimizer
    state) and its parameters' gradients, by ``(i, j)``: a union of names, summed once per
    interval (a parameter two items read is held once)."""
    costs = search.costs
    held: dict[tuple[int, int], int] = {}
    grads: dict[tuple[int, int], int] = {}
    for i in range(costs.count):
        names: set[str] = set()
        total = params_total = 0
        for j in range(i + 1, costs.count + 1):
            new = costs.state[j - 1] - names
            if new:
                params, buffers, opt = state_bytes(search, new, optimizer_state)
                total += params + buffers + opt
                params_total += params
                names |= new
            held[i, j] = total
            grads[i, j] = params_total
    return held, grads


def _no_split_fits(
    stages: int, budget: int | None, refused: int, least_capacity: float
) -> BudgetError:
    """The error of a cut search with no split within ``budget``: the least budget the search's
    own estimate fits, unless memfit's planner refused spans (then that estimate is too low)."""
    if refused:
        return BudgetError(
            f"no split into {stages} stages fits {format_bytes(budget or 0)} per device: "
            f"memfit's planner could not fit {refused} stage spans the search proposed, "
            "and no other split fits the search's own estimate",
            budget_bytes=budget,
        )
    return BudgetError(
        f"no split into {stages} stages fits {format_bytes(budget or 0)} per device, even "
        f"with every activation recomputed inside the stages; the smallest per-device "
        f"budget that fits is about {format_bytes(int(least_capacity))}",
        budget_bytes=budget,
        least_bytes=int(math.ceil(least_capacity)),
    )


#: how many stage spans memfit's planner may refuse before the search gives up
MAX_REFUSALS = 16


def refuse(refused: set[Span], stage: StageGraph, err: BudgetError, stages: int) -> None:
    """Note a span the planner could not fit; raise ``err`` once too many were refused.

    The cut search's stage model (GPipe's: everything recomputed) is an estimate; memfit's
    planner, which decides what the stage really keeps, may need more. Then the search runs
    again without that span, until a split whose every stage the planner fits is found.
    """
    refused.add((stage.index, stage.start, stage.end))
    if len(refused) > max(MAX_REFUSALS, 2 * stages):
        raise BudgetError(
            f"{err} (and {len(refused) - 1} other stage spans the search proposed did not fit "
            "either)",
            budget_bytes=err.budget_bytes,
            least_bytes=err.least_bytes,
        )


@dataclass(frozen=True)
class StagesFound:
    """A split every planned stage fits: the cuts, the stage graphs they make, each stage's
    example inputs, and memfit's plan of each stage this process planned, by stage index."""

    cuts: list[int]
    graphs: list[StageGraph]
    examples: list[tuple[torch.Tensor, ...]]
    plans: dict[int, StagePlan]


def search_stages(
    search: Search,
    micro: tuple[Any, ...],
    config: Configuration,
    *,
    planned_here: Sequence[int] | None = None,
    choose: Callable[[frozenset[Span]], list[int]] | None = None,
    share: Callable[[dict[int, BudgetError]], dict[int, BudgetError]] | None = None,
    exact: bool = True,
) -> StagesFound:
    """Cut, plan the stages with memfit's planner, and cut again around every span it refuses.

    The stages are planned rank by rank, a rank's together (``stage_planner.plan_rank``); a rank
    that does not fit refuses its largest stage's span. One process plans every stage
    (``plan``); ``Pipeline`` plans only its rank's (``planned_here``), takes the cuts rank 0
    chose (``choose``, given the spans refused so far; default ``choose_cuts``) and gathers
    every rank's refusal (``share``, given this process's and returning all of them), so that
    every rank refuses the same spans and searches again alike (``exact``: see
    ``stage_planner``). Raises ``BudgetError`` when no split fits, or when too many spans were
    refused (``refuse``), with the least peak the planner reached on a refused split when the
    search's estimate gives none.
    """
    refused: set[Span] = set()
    tried: set[tuple[int, ...]] = set()
    reached: list[int] = []  # the planner's least peak of each refused rank
    while True:
        try:
            if choose is None:
                cuts = choose_cuts(search, config, frozenset(refused))
            else:
                cuts = choose(frozenset(refused))
            if tuple(cuts) in tried:  # a ``choose`` that ignores refusals would loop forever
                raise BudgetError(
                    f"the split {list(cuts)} was proposed again after memfit's planner refused it",
                    budget_bytes=config.budget,
                )
        except BudgetError as err:
            if err.least_bytes is not None or not reached:
                raise
            raise BudgetError(
                f"{err}; the least peak memfit's planner reached on a rank of a split it tried "
                f"is {format_bytes(min(reached))}",
                budget_bytes=err.budget_bytes,
                least_bytes=min(reached),
            ) from None
        tried.add(tuple(cuts))
        graphs = split_stages(search.captured, cuts)
        examples = stage_inputs(graphs, micro, search.captured)
        plans: dict[int, StagePlan] = {}
        failed: dict[int, BudgetError] = {}
        placed = stage_ranks(config.schedule, config.ranks, config.stages_per_rank)
        here = range(len(graphs)) if planned_here is None else planned_here
        for rank in sorted({placed[s] for s in here}):
            facts = [
                stage_facts(search, graphs[s], examples[s], config)
                for s in here
                if placed[s] == rank
            ]
            try:
                plans.update(plan_rank(search, facts, config, exact=exact))
            except StageRefused as refusal:
                failed[refusal.stage] = refusal.error
                break  # the split changes: the later ranks' plans would not be used
        if share is not None:
            failed = share(failed)
        if not failed:
            return StagesFound(cuts, graphs, examples, plans)
        for s in sorted(failed):
            least = failed[s].least_bytes
            reached += [least] if least is not None else []
            refuse(refused, graphs[s], failed[s], config.stages)


def plan_from_search(
    search: Search, micro: tuple[Any, ...], config: Configuration, *, exact: bool = True
) -> PipelinePlan:
    """The plan of ``config``'s pipeline over a captured and profiled model (``search``, on
    the micro-batch ``micro``; ``exact``: see ``stage_planner``): what ``plan`` returns, and
    what ``auto`` makes of each configuration it compares."""
    found = search_stages(search, micro, config, exact=exact)
    return PipelinePlan(
        stages=tuple(found.plans[s] for s in range(len(found.graphs))),
        schedule=config.schedule,
        microbatches=config.microbatches,
        cuts=tuple(found.cuts),
        budget_bytes=config.budget,
        candidate_cuts=search.costs.count - 1,
        stages_per_rank=config.stages_per_rank,
        overhead=config.overhead,
        latency=config.latency,
    )
