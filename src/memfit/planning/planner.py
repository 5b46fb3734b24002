"""Turn a policy into a ``GraphPlan`` for one joint graph: its decisions and their prediction.

The guard against the failure the original tool had (checkpoints that used *more* memory than
none) lives here: ``"memory"`` and ``"speed"`` are compared with the plain plan in the simulator
and fall back to it when they would not save anything.

The budget policy answers from the graph's Pareto frontier (``planning.frontier``): the cheapest
simulated plan whose predicted peak is within the budget, or ``BudgetError`` naming the least peak
reachable. ``"memory"`` is the frontier's lowest point, so it equals the budget plan at the
smallest feasible budget.

Every number the plan reports comes from one simulation of the chosen decisions on the very graph
the executor splits (the rewrites of ``capture.passes`` ran before), so what the plan says is what
runs, and a budget plan's predicted peak is within its budget by construction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch.fx as fx

from memfit.analysis.cost import keeping_seconds, node_flops, node_seconds
from memfit.analysis.graph import JointGraph
from memfit.analysis.simulate import StepSimulation, simulate_step
from memfit.analysis.transfers import Link, TransferSchedule
from memfit.planning.budget import BudgetError
from memfit.planning.decision import Decision
from memfit.planning.frontier import (
    Candidate,
    activations,
    choose,
    least_kept_point,
    least_peak_point,
    pareto_frontier,
)
from memfit.planning.fusion import fused_plan
from memfit.planning.keep_rules import keep_all, keep_heavy, keep_marked
from memfit.planning.offload import MIN_OFFLOAD_BYTES, swap, with_offload
from memfit.planning.paused_gc import paused_gc
from memfit.planning.plan import FrontierPoint, GraphPlan, TransferPlan
from memfit.planning.policy import Policy
from memfit.planning.step_budget import GraphShare
from memfit.units import format_bytes

__all__ = ["FrontierCache", "plan_graph", "with_executor_peaks"]

#: The named policies the planner answers with one keep-set rule ("memory" and budgets use the
#: frontier instead).
_KEEP_RULES: dict[str, Callable[[JointGraph], set[fx.Node]]] = {
    "none": keep_all,
    "speed": keep_heavy,
    "collection": keep_marked,
}


class FrontierCache:
    """One graph's frontier, computed by its first plan and read by the later ones.

    Why: under ``executor="inductor"`` the measured search (``planning.measured_search``) plans
    one graph up to ``SCHEDULE_TRIES`` times, with different headroom, and the frontier does not
    depend on the headroom, only which of its points is chosen does. Computing it once per plan
    was most of a ResNet's first step: four frontiers of 24 min-cut solves each, 107 of 225 s
    (profiled, CPU, 2 threads). A cache belongs to one graph and one set of offload options
    (link, limits); frontiers with and without offload plans are kept apart.
    """

    def __init__(self, jg: JointGraph) -> None:
        self.jg = jg
        #: the frontier by whether it includes offload plans
        self.points: dict[bool, list[Candidate]] = {}


@paused_gc()  # planning's garbage collected once, as it ends (planning.paused_gc)
def plan_graph(
    jg: JointGraph,
    policy: Policy,
    *,
    spent_bytes: int = 0,
    link: Link | None = None,
    offload_to: str | None = None,
    offload_min_bytes: int = MIN_OFFLOAD_BYTES,
    offload_limit_bytes: int | None = None,
    share: GraphShare | None = None,
    first_plan: bool = False,
    headroom_bytes: int = 0,
    cache: FrontierCache | None = None,
    least_kept: bool = False,
) -> GraphPlan:
    """Decide, under ``policy``, what ``jg``'s backward gets for every forward value it reads.

    ``spent_bytes`` is what earlier graphs of the same step keep (with graph breaks their kept
    values are alive while this graph runs) and is taken off a byte budget; a fraction applies to
    this graph's own activations. That is how the first call of a step with graph breaks plans each
    graph as it reaches it; the step is then checked as a whole (``planning.step_budget``) and each
    graph planned again with its ``share`` of the step's budget. With ``first_plan``, a graph that
    cannot meet a fraction on its own, or a byte budget beside what earlier graphs kept, gets its
    least-peak plan instead of an error: whether the step fits is decided once all its graphs are
    known, and so is a graph that cannot meet its share.
    Policies that offload need the ``link`` they offload over (and ``offload_to``, its name for the
    plan); ``offload_limit_bytes`` caps what one graph may offload (the host budget, or the free
    space of the offload disk). ``headroom_bytes`` is taken off a budget for what the executor holds
    beyond the simulation (Inductor's schedule, measured on a plan compiled before:
    ``execution.partitioner``). With a ``cache`` of ``jg``, the frontier is computed once for all
    the plans asked of it. ``least_kept``: the graph is one of a step's chain of graphs
    (``planning.chain``) for which ``"memory"`` keeps the least it can (``least_kept_point``).
    """
    if cache is not None and cache.jg is not jg:
        raise ValueError("plan_graph: the frontier cache belongs to another graph")
    if policy.offload and link is None:
        raise ValueError(f"policy {policy.label!r} offloads: plan_graph needs the link's bandwidth")
    baseline = keep_all(jg)
    base_sim = simulate_step(jg, baseline)
    note = ""
    frontier: tuple[FrontierPoint, ...] = ()
    budget_bytes: int | None = None
    schedule: TransferSchedule | None = None
    seconds = {n: node_seconds(n, jg.sizes) for n in jg.nodes} if policy.offload else {}

    def frontier_points() -> list[Candidate]:
        """The graph's frontier, with offload plans added when the policy offloads."""
        if cache is not None and policy.offload in cache.points:
            return cache.points[policy.offload]
        points = pareto_frontier(jg)
        if policy.offload:
            assert link is not None
            points = with_offload(
                jg,
                points,
                link,
                seconds,
                min_bytes=offload_min_bytes,
                limit_bytes=offload_limit_bytes,
            )
        if cache is not None:
            cache.points[policy.offload] = points
        return points

    if policy.budget is not None:
        points = frontier_points()
        frontier = tuple(
            FrontierPoint(
                p.peak_bytes,
                p.recompute_flops,
                p.recompute_seconds,
                _reported_bytes(jg, set(p.kept), _offloaded(p)),
                offloaded_bytes=p.schedule.offloaded_bytes if p.schedule else 0,
                stall_seconds=p.stall_seconds,
                keep_seconds=p.keep_seconds,
            )
            for p in points
        )
        fraction = policy.budget.fraction if share is None else None
        if share is not None:
            budget_bytes = share.peak_bytes
            allowed_points = [
                p for p, q in zip(points, frontier) if q.kept_bytes <= share.kept_bytes
            ]
        else:
            budget_bytes = policy.budget.resolve(
                base_sim.peak_bytes, _activation_bytes(jg, baseline)
            )
            allowed_points = points
        if fraction is not None:
            budget_bytes = _fraction_reach(jg, points, fraction, budget_bytes)
        # A fraction is of this graph's own activations; bytes are shared with earlier graphs.
        allowed = budget_bytes if fraction is not None or share else budget_bytes - spent_bytes
        allowed -= headroom_bytes
        try:
            chosen = choose(allowed_points or points, allowed)
        except BudgetError as err:
            if share is not None or (first_plan and (fraction is not None or spent_bytes)):
                chosen = min(points, key=lambda p: (p.peak_bytes, p.cost_seconds))
                note = f"{err}; planned at its least peak until the step is checked as a whole"
                return describe_plan(
                    jg,
                    policy,
                    set(chosen.kept),
                    chosen.simulation,
                    base_sim,
                    baseline,
                    note=note,
                    budget_bytes=budget_bytes,
                    step_budget_bytes=share.step_budget_bytes if share else None,
                    frontier=frontier,
                    schedule=chosen.schedule
                    if chosen.schedule and chosen.schedule.transfers
                    else None,
                    offload_to=offload_to,
                )
            if policy.offload and offload_limit_bytes is not None:
                raise _explained(
                    err,
                    f"offload was limited to {format_bytes(offload_limit_bytes)} per step by the "
                    f"host budget or the free space of the offload disk",
                ) from None
            if jg.outside_bytes:
                raise _explained(
                    err,
                    f"including {format_bytes(jg.outside_bytes)} the step was measured to hold "
                    f"outside memfit's graphs between forward and backward, e.g. a loss computed "
                    f"outside the model; memfit.step plans the loss too",
                ) from None
            if spent_bytes and fraction is None:
                raise _explained(
                    err,
                    f"{spent_bytes} bytes of the budget are already kept by earlier graphs of "
                    f"this step: the model has graph breaks",
                ) from None
            raise
        kept, sim, schedule = set(chosen.kept), chosen.simulation, chosen.schedule
    elif policy.least_memory:
        # The least peak on the frontier: the cut heuristic ("keep_min_peak") is one of its
        # candidates, and the segment programme often finds a lower peak for less recompute.
        # Under Inductor, the cheapest within the frontier's gap of it.
        points = frontier_points()
        if least_kept:
            lowest = least_kept_point(jg, points)
        else:
            lowest = least_peak_point(points, base_sim.peak_bytes, estimate=jg.fused_elementwise)
        kept, sim, schedule = set(lowest.kept), lowest.simulation, lowest.schedule
    elif policy.swaps:
        assert link is not None
        swapped = swap(
            jg,
            baseline,
            base_sim,
            link,
            seconds,
            min_bytes=offload_min_bytes,
            limit_bytes=offload_limit_bytes,
        )
        kept, sim, schedule = set(baseline), swapped.simulation, swapped.schedule
    else:
        kept = _KEEP_RULES[policy.name](jg)
        if policy.name == "speed" and jg.fused_elementwise:
            # Under Inductor, "recompute only cheap ops" includes what fuses into the backward's
            # kernels (``planning.fusion``), as torch.compile's partitioner does.
            kept = fused_plan(jg, kept)
        sim = simulate_step(jg, kept)
    # A graph of a chain is judged by the step's peak (planning.chain), not by its own.
    if policy.never_worse_than_none and not least_kept and sim.peak_bytes > base_sim.peak_bytes:
        note = (
            f"{policy.name!r} would peak above plain autograd here "
            f"({sim.peak_bytes} > {base_sim.peak_bytes} B): kept everything instead"
        )
        kept, sim, schedule = baseline, base_sim, None
    if schedule is not None and not schedule.transfers:
        schedule = None
    return describe_plan(
        jg,
        policy,
        kept,
        sim,
        base_sim,
        baseline,
        note=note,
        budget_bytes=budget_bytes,
        frontier=frontier,
        schedule=schedule,
        offload_to=offload_to,
        step_budget_bytes=share.step_budget_bytes if share else None,
    )


def _fraction_reach(jg: JointGraph, points: list[Candidate], fraction: float, resolved: int) -> int:
    """The peak a fraction allows: ``resolved`` (plain autograd's, less the activations it
    gives up), or, where recomputation's working memory keeps every plan that holds at most
    ``fraction`` of the activations above that, the least peak of such a plan. So a fraction
    is met whenever some plan keeps that share of the activations, as users read it."""
    limit = fraction * _activation_bytes(jg, keep_all(jg))
    reach = [
        p.peak_bytes for p in points if _activation_bytes(jg, set(p.kept) - _offloaded(p)) <= limit
    ]
    return max(resolved, min(reach)) if reach else resolved


def _reported(jg: JointGraph, kept: set[fx.Node], offloaded: set[fx.Node]) -> list[fx.Node]:
    """What a plan reports as kept: its ``activations`` less what it offloads."""
    return [n for n in activations(jg, kept) if n not in offloaded]


def _reported_bytes(jg: JointGraph, kept: set[fx.Node], offloaded: set[fx.Node]) -> int:
    return jg.bytes_of(_reported(jg, kept, offloaded))


def _offloaded(point: Candidate) -> set[fx.Node]:
    return {t.value for t in point.schedule.transfers} if point.schedule else set()


def _activation_bytes(jg: JointGraph, kept: set[fx.Node]) -> int:
    """Bytes ``kept`` holds for backward beyond the step's outputs and inputs: the activations
    a budget fraction is a fraction of."""
    outputs = set(jg.fwd_outputs)
    return jg.bytes_of(n for n in kept if n.op != "placeholder" and n not in outputs)


def _explained(err: BudgetError, reason: str) -> BudgetError:
    """``err`` with ``reason`` added to its message, its numbers kept."""
    return BudgetError(
        f"{err} ({reason})", budget_bytes=err.budget_bytes, least_bytes=err.least_bytes
    )


def _decisions(
    jg: JointGraph, kept: set[fx.Node], sim: StepSimulation, offloaded: set[fx.Node]
) -> dict[str, Decision]:
    """``KEEP`` for what the backward receives from the forward, ``OFFLOAD`` for what it receives
    through host memory or disk, ``RECOMPUTE`` for the forward values it computes again (``sim``
    is the simulation of keeping ``kept``)."""
    saved = jg.saved_needed(kept)
    forward = set(jg.forward)
    recomputed = {n for n in sim.backward if n in forward and jg.is_tensor_value(n)}

    def decision(n: fx.Node) -> Decision:
        if n in offloaded:
            return Decision.OFFLOAD
        return Decision.KEEP if n in saved else Decision.RECOMPUTE

    return {n.name: decision(n) for n in jg.nodes if n in saved or n in recomputed}


def describe_plan(
    jg: JointGraph,
    policy: Policy,
    kept: set[fx.Node],
    sim: StepSimulation,
    base_sim: StepSimulation,
    baseline: set[fx.Node],
    *,
    note: str,
    budget_bytes: int | None,
    frontier: tuple[FrontierPoint, ...],
    schedule: TransferSchedule | None = None,
    offload_to: str | None = None,
    step_budget_bytes: int | None = None,
) -> GraphPlan:
    """The ``GraphPlan`` that keeps ``kept`` on ``jg`` (``sim`` its simulation, ``base_sim``
    plain autograd's): its decisions and every number reported about them, at ``jg.sizes``."""
    forward_set = set(jg.forward)
    transfers = schedule.transfers if schedule else ()
    offloaded = {t.value for t in transfers}
    recomputed = [n for n in sim.backward if n in forward_set]
    reported = _reported(jg, kept, offloaded)
    return GraphPlan(
        policy=policy.name,
        decisions=_decisions(jg, kept, sim, offloaded),
        kept=tuple(n.name for n in reported),
        recomputed=tuple(n.name for n in recomputed),
        kept_bytes=jg.bytes_of(reported),
        predicted_peak_bytes=sim.peak_bytes,
        baseline_peak_bytes=base_sim.peak_bytes,
        baseline_kept_bytes=_activation_bytes(jg, baseline),
        recompute_flops=sum(node_flops(n, jg.sizes) for n in recomputed),
        forward_flops=sum(node_flops(n, jg.sizes) for n in jg.forward_computed),
        num_nodes=len(jg.nodes),
        note=note,
        recompute_seconds=float(
            sum(node_seconds(n, jg.sizes, jg.fused_elementwise) for n in recomputed)
        ),
        keep_seconds=keeping_seconds(jg, activations(jg, kept)),
        budget_bytes=budget_bytes,
        step_budget_bytes=step_budget_bytes,
        frontier=frontier,
        forward_end_bytes=sim.forward_end_bytes,
        forward_peak_bytes=max(sim.forward_peak_bytes, sim.forward_end_bytes + jg.outside_bytes),
        backward_peak_bytes=sim.backward_peak_bytes,
        output_bytes=jg.bytes_of(jg.fwd_outputs),
        parameter_grad_bytes=jg.parameter_grad_bytes(),
        outside_bytes=jg.outside_bytes,
        transfers=tuple(
            TransferPlan(t.value.name, t.nbytes, t.wait_after.name, t.prefetch_before.name)
            for t in transfers
        ),
        offload_to=offload_to if transfers else None,
        transfer_seconds=schedule.transfer_seconds if schedule else 0.0,
        stall_seconds=schedule.stall_seconds if schedule else 0.0,
    )


def with_executor_peaks(
    plan: GraphPlan,
    forward_peak: int,
    backward_peak: int,
    *,
    forward_end: int | None = None,
    source: str,
) -> GraphPlan:
    """``plan`` predicted from the peaks of its forward and backward as the executor runs them
    (measured once, or from Inductor's schedule: ``execution.inductor_fit``) instead of from the
    op-by-op simulation. What the step holds between the two (a loss outside the graph) stays
    reserved on top of what the forward leaves alive (``forward_end``; the simulation's when not
    given). ``source`` says where the peaks come from, in the plan's note."""
    end = plan.forward_end_bytes if forward_end is None else forward_end
    forward = max(forward_peak, end + plan.outside_bytes)
    note = f"peak predicted from {source}"
    return dataclasses.replace(
        plan,
        predicted_peak_bytes=max(forward, backward_peak),
        forward_end_bytes=end,
        forward_peak_bytes=forward,
        backward_peak_bytes=backward_peak,
        note=f"{plan.note}; {note}" if plan.note else note,
    )
