"""Turn a policy into a ``GraphPlan`` for one joint graph, with its predicted memory and cost.

The guard against the failure the original tool had (checkpoints that used *more* memory than
none) lives here: the automatic policies are compared with the plain plan in the simulator and
fall back to it when they would not save anything.

The ``"budget"`` policy answers from the graph's Pareto frontier (``planning.frontier``): the
cheapest simulated plan whose predicted peak is within the budget, or ``BudgetError`` naming the
least peak reachable. ``"memory"`` is the frontier's lowest point, so it equals the budget plan at
the smallest feasible budget.
"""

from __future__ import annotations

import torch.fx as fx

from memfit.analysis.cost import node_flops, node_seconds
from memfit.analysis.graph import JointGraph
from memfit.analysis.simulate import simulate_step
from memfit.planning.budget import Budget, BudgetError
from memfit.planning.frontier import choose, pareto_frontier
from memfit.planning.plan import GraphPlan, ParetoPoint
from memfit.planning.policies import POLICIES, keep_all

__all__ = ["plan_graph", "AUTOMATIC_POLICIES"]

AUTOMATIC_POLICIES = ("memory", "speed")


def plan_graph(
    jg: JointGraph, policy: str, *, budget: Budget | None = None, spent_bytes: int = 0,
) -> tuple[set[fx.Node], set[fx.Node], GraphPlan]:
    """Choose what to keep in ``jg`` under ``policy``.

    With ``policy="budget"``, ``budget`` is required; ``spent_bytes`` is what earlier graphs of
    the same step keep (with graph breaks their kept values are alive while this graph runs) and
    is taken off a byte budget. A fraction applies to this graph's own plain-autograd peak.

    Returns the kept nodes, the forward nodes the backward recomputes, and the plan summary.
    """
    baseline = keep_all(jg)
    base_sim = simulate_step(jg, baseline)
    note = ""
    frontier: tuple[ParetoPoint, ...] = ()
    budget_bytes: int | None = None
    if policy == "budget":
        if budget is None:
            raise ValueError("the 'budget' policy needs a budget")
        points = pareto_frontier(jg)
        frontier = tuple(ParetoPoint(p.peak_bytes, p.recompute_flops, p.recompute_seconds,
                                     p.simulation.saved_bytes) for p in points)
        if budget.fraction is not None:
            budget_bytes = budget.resolve(base_sim.peak_bytes)
        else:
            budget_bytes = budget.resolve(base_sim.peak_bytes) - spent_bytes
        try:
            chosen = choose(points, budget_bytes)
        except BudgetError as err:
            if spent_bytes and budget.fraction is None:
                raise BudgetError(
                    f"{err} ({spent_bytes} bytes of the budget are already kept by earlier "
                    f"graphs of this step: the model has graph breaks)",
                    budget_bytes=budget_bytes, smallest_bytes=err.smallest_bytes,
                ) from None
            raise
        kept, sim = set(chosen.kept), chosen.simulation
    elif policy == "memory":
        # The least peak on the frontier: the cut heuristic ("keep_min_peak") is one of its
        # candidates, and the segment programme often finds a lower peak for less recompute.
        lowest = pareto_frontier(jg)[0]
        kept, sim = set(lowest.kept), lowest.simulation
    else:
        kept = baseline if policy == "none" else POLICIES[policy](jg)
        sim = simulate_step(jg, kept)
        if policy in AUTOMATIC_POLICIES and sim.peak_bytes > base_sim.peak_bytes:
            note = (f"{policy!r} would peak above plain autograd here "
                    f"({sim.peak_bytes} > {base_sim.peak_bytes} B): kept everything instead")
            kept, sim = baseline, base_sim
    forward_set = set(jg.forward)
    recomputed = [n for n in sim.backward if n in forward_set]
    # What the plan reports as kept: activations held for backward beyond what the step returns
    # anyway (its outputs) and what existed before it (parameters, inputs).
    outputs = set(jg.fwd_outputs)
    reported = [n for n in jg.nodes if n in kept and n.op != "placeholder" and n not in outputs]
    base_reported = [n for n in baseline if n.op != "placeholder" and n not in outputs]
    return kept, set(recomputed), GraphPlan(
        policy=policy,
        kept=tuple(n.name for n in reported),
        recomputed=tuple(n.name for n in recomputed),
        kept_bytes=jg.bytes_of(reported),
        predicted_peak_bytes=sim.peak_bytes,
        baseline_peak_bytes=base_sim.peak_bytes,
        baseline_kept_bytes=jg.bytes_of(base_reported),
        recompute_flops=sum(node_flops(n) for n in recomputed),
        forward_flops=sum(node_flops(n) for n in jg.forward),
        num_nodes=len(jg.nodes),
        note=note,
        recompute_seconds=float(sum(node_seconds(n) for n in recomputed)),
        budget_bytes=budget_bytes,
        frontier=frontier,
    )
