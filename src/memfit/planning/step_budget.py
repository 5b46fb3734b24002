"""A budget for a whole step that Dynamo captured in several graphs (graph breaks).

Dynamo compiles the graphs of a step one after the other as its first call reaches them, so
each is planned before the ones after it exist: with the budget less what earlier graphs keep
(bytes) or with the fraction applied to its own activations. That is not the step's budget:
earlier graphs' transients run while later graphs' kept values or gradients are alive (measured:
an MLP split by one break, budget 22.4 MiB, peaked at 24.0 MiB), and a fraction of each graph is
not a fraction of the step (a small loss graph that can drop nothing made ``budget=0.5`` fail on
GPT-2).

So once a call has run all of a step's graphs, the step is planned as a whole from the graphs'
frontiers (every budget plan carries its simulated Pareto frontier): one point per graph, the
cheapest recomputation whose step peak fits the step's budget, found by a dynamic programme over
the graphs in their order (``_search``). Each graph is then planned again, on the next call,
with its ``GraphShare``: the chosen point's peak and kept bytes as its limits.

A region (a submodule recomputed whole, ``Plan.regions``) is one part of that order with a
single choice (``Plan.region_part``): its graphs are planned with ``"none"`` and get no share.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.planning.budget import Budget
from memfit.planning.plan import FrontierPoint, GraphPlan, Plan

__all__ = ["GraphShare", "step_budget_bytes", "planned_as_step", "share_step", "least_step_peak"]


@dataclass(frozen=True)
class GraphShare:
    """One graph's part of a step's budget: its peak and kept bytes may not exceed these."""

    step_budget_bytes: int
    peak_bytes: int
    kept_bytes: int


def _points(graph: GraphPlan) -> list[FrontierPoint]:
    if graph.frontier:
        return list(graph.frontier)
    # No frontier (not planned with a budget): the plan itself is the only choice.
    return [
        FrontierPoint(
            graph.predicted_peak_bytes,
            0,
            graph.recompute_seconds,
            graph.kept_bytes,
            keep_seconds=graph.keep_seconds,
        )
    ]


def _fixed(plan: Plan) -> list[int]:
    """For each part of the step in order, what the step holds beside it that no choice of
    plans changes: the outputs of the parts before it, and in its backward the parameter
    gradients of the parts after it."""
    graphs = plan.parts()
    return [
        sum(h.output_bytes for h in graphs[:i])
        + sum(h.parameter_grad_bytes for h in graphs[i + 1 :])
        for i in range(len(graphs))
    ]


_State = tuple[int, int, float, dict[str, FrontierPoint]]  # (kept before, peak, cost, choice)

#: Partial choices the search keeps after pruning (a step has few graphs and short frontiers;
#: this bounds a pathological one).
_MAX_STATES = 4000


def _prune(states: list[_State], ahead: set[str]) -> list[_State]:
    """Drop every state another one beats or ties on kept bytes, peak and cost, among states
    that chose alike for the graphs ``ahead`` that run again (their choice binds later)."""
    groups: dict[tuple[int, ...], list[_State]] = {}
    for s in states:
        signature = tuple(id(p) for k, p in sorted(s[3].items()) if k in ahead)
        groups.setdefault(signature, []).append(s)
    kept: list[_State] = []
    for group in groups.values():
        group.sort(key=lambda s: (s[0], s[1], s[2]))
        best: list[_State] = []
        for s in group:
            if not any(b[1] <= s[1] and b[2] <= s[2] for b in best):  # b[0] <= s[0]: sorted
                best.append(s)
        kept.extend(best)
    if len(kept) > _MAX_STATES:
        kept = sorted(kept, key=lambda s: (s[2], s[1]))[:_MAX_STATES]
    return kept


def _search(
    plan: Plan, budget_bytes: int | None, kept_limit: int | None
) -> tuple[int, float, dict[str, FrontierPoint]] | None:
    """The cheapest choice of one point per graph (by key) whose step peak is within
    ``budget_bytes`` (None: the least step peak), keeping at most ``kept_limit`` bytes in all:
    (step peak, cost, points by key), or None when nothing fits.

    The graphs run forward in order and backward in reverse, so while graph ``g`` runs the
    graphs before it hold what they keep: the step peak is the largest, over the graphs, of
    what the earlier graphs keep plus the graph's own peak plus what the step holds beside it
    whatever is chosen (``_fixed``): ``Plan.predicted_peak_bytes`` with each graph's forward
    and backward peaks bounded by its peak. A dynamic programme over the graphs in order, on
    Pareto sets of (kept so far, peak so far, cost); a graph that runs twice gets one choice
    (and costs twice).
    """
    fixed = _fixed(plan)
    parts = plan.parts()
    states: list[_State] = [(0, 0, 0.0, {})]
    for i, (graph, extra) in enumerate(zip(parts, fixed)):
        chosen_before = [s[3].get(graph.sized_key) for s in states]
        grown: list[_State] = []
        for s, before in zip(states, chosen_before):
            prefix, peak, cost, choice = s
            for p in [before] if before is not None else _points(graph):
                step_peak = max(peak, prefix + p.peak_bytes + extra)
                kept = prefix + p.kept_bytes
                if budget_bytes is not None and step_peak > budget_bytes:
                    continue
                if kept_limit is not None and kept > kept_limit:
                    continue
                grown.append(
                    (kept, step_peak, cost + p.cost_seconds, {**choice, graph.sized_key: p})
                )
        states = _prune(grown, {g.sized_key for g in parts[i + 1 :]})
        if not states:
            return None
    if budget_bytes is None:
        best = min(states, key=lambda s: (s[1], s[2]))
    else:
        best = min(states, key=lambda s: (s[2], s[1]))
    return best[1], best[2], best[3]


def step_budget_bytes(budget: Budget, plan: Plan) -> int:
    """The byte budget of the step ``plan`` describes: bytes as given, or a fraction of the
    activations plain autograd keeps over all the step's graphs, the rest of the step added;
    where recomputation's working memory keeps that above every combination keeping at most
    the fraction of the activations, the least combined peak of such a combination."""
    if budget.bytes is not None:
        return budget.bytes
    assert budget.fraction is not None
    resolved = budget.resolve(plan.baseline_peak_bytes, plan.baseline_kept_bytes)
    reach = _search(plan, None, int(budget.fraction * plan.baseline_kept_bytes))
    return max(resolved, reach[0]) if reach else resolved


def planned_as_step(plan: Plan, budget_bytes: int) -> bool:
    """Whether ``plan``'s graphs were planned together under ``budget_bytes`` and fit it."""
    return (
        all(g.step_budget_bytes == budget_bytes for g in plan.outside_regions())
        and plan.predicted_peak_bytes <= budget_bytes
    )


def share_step(plan: Plan, budget_bytes: int) -> dict[str, GraphShare] | None:
    """Each graph's share (by ``GraphPlan.sized_key``) of the cheapest combination within
    ``budget_bytes``."""
    found = _search(plan, budget_bytes, None)
    if found is None:
        return None
    graphs = {g.sized_key for g in plan.outside_regions()}  # a region's part gets no share
    return {
        key: GraphShare(budget_bytes, p.peak_bytes, p.kept_bytes)
        for key, p in found[2].items()
        if key in graphs
    }


def least_step_peak(plan: Plan) -> int:
    """The least combined peak any choice of the graphs' plans reaches."""
    found = _search(plan, None, None)
    assert found is not None
    return found[0]
