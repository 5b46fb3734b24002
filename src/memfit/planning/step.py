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
cheapest recomputation whose combined peak fits the step's budget. The combination is the one
``Plan.predicted_peak_bytes`` makes: every graph's kept bytes plus the largest transient above a
graph's own kept bytes. The search is exact: for each candidate largest transient ``T``, a
multiple-choice knapsack over the graphs' kept bytes (at most ``budget - T``), solved on Pareto
sets of (kept, cost) partial sums. Each graph is then planned again, on the next call, with its
``GraphShare``: the point's peak and kept bytes as its limits.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.planning.budget import Budget
from memfit.planning.plan import GraphPlan, ParetoPoint, Plan

__all__ = ["GraphShare", "step_budget_bytes", "planned_as_step", "share_step", "least_step_peak"]


@dataclass(frozen=True)
class GraphShare:
    """One graph's part of a step's budget: its peak and kept bytes may not exceed these."""

    step_budget_bytes: int
    peak_bytes: int
    kept_bytes: int


def _groups(plan: Plan) -> list[tuple[GraphPlan, int]]:
    """The step's distinct graphs with how often each ran (a graph run twice keeps twice)."""
    counts: dict[str, tuple[GraphPlan, int]] = {}
    for g in plan.graphs:
        first, n = counts.get(g.key, (g, 0))
        counts[g.key] = (first, n + 1)
    return list(counts.values())


def _points(graph: GraphPlan) -> list[ParetoPoint]:
    if graph.frontier:
        return list(graph.frontier)
    # No frontier (not planned with a budget): the plan itself is the only choice.
    return [ParetoPoint(graph.predicted_peak_bytes, 0, graph.recompute_seconds, graph.kept_bytes)]


def _cost(p: ParetoPoint) -> float:
    return p.recompute_seconds + p.stall_seconds


def _search(
    plan: Plan, budget_bytes: int | None, kept_limit: int | None
) -> tuple[int, float, list[ParetoPoint]] | None:
    """The cheapest choice of one point per graph whose combined peak is within
    ``budget_bytes`` (None: the least combined peak) and whose kept bytes sum to at most
    ``kept_limit``: (combined peak, cost, points by group), or None when nothing fits."""
    groups = _groups(plan)
    options = [_points(g) for g, _ in groups]
    transients = sorted({p.peak_bytes - p.kept_bytes for pts in options for p in pts})
    best: tuple[tuple[float, float], int, float, list[ParetoPoint]] | None = None
    for t in transients:
        room = None if budget_bytes is None else budget_bytes - t
        if kept_limit is not None:
            room = kept_limit if room is None else min(room, kept_limit)
        if room is not None and room < 0:
            continue
        # Pareto set of (kept, cost, choice) over the groups so far.
        states: list[tuple[int, float, list[ParetoPoint]]] = [(0, 0.0, [])]
        for (_, times), pts in zip(groups, options):
            usable = [p for p in pts if p.peak_bytes - p.kept_bytes <= t]
            if not usable:
                states = []
                break
            grown = [
                (kept + times * p.kept_bytes, cost + times * _cost(p), [*chosen, p])
                for kept, cost, chosen in states
                for p in usable
                if room is None or kept + times * p.kept_bytes <= room
            ]
            grown.sort(key=lambda s: (s[0], s[1]))
            states = []
            for s in grown:  # keep each state not dominated by one keeping less
                if not states or s[1] < states[-1][1]:
                    states.append(s)
        for kept, cost, chosen in states:
            combined = kept + max(p.peak_bytes - p.kept_bytes for p in chosen)
            rank = (float(combined), cost) if budget_bytes is None else (cost, float(combined))
            if best is None or rank < best[0]:
                best = (rank, combined, cost, chosen)
    return None if best is None else best[1:]


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
        all(g.step_budget_bytes == budget_bytes for g in plan.graphs)
        and plan.predicted_peak_bytes <= budget_bytes
    )


def share_step(plan: Plan, budget_bytes: int) -> dict[str, GraphShare] | None:
    """Each graph's share (by key) of the cheapest combination within ``budget_bytes``."""
    found = _search(plan, budget_bytes, None)
    if found is None:
        return None
    return {
        g.key: GraphShare(budget_bytes, p.peak_bytes, p.kept_bytes)
        for (g, _), p in zip(_groups(plan), found[2])
    }


def least_step_peak(plan: Plan) -> int:
    """The least combined peak any choice of the graphs' plans reaches."""
    found = _search(plan, None, None)
    assert found is not None
    return found[0]
