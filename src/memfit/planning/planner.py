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
from memfit.planning.policy import BUDGET, Policy
from memfit.planning.step_budget import GraphShare
from memfit.units import format_bytes

__all__ = ["FrontierCache", "plan_graph", "with_executor_peaks"]


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


@dataclasses.dataclass
class _Request:
    """What ``plan_graph`` was asked, with plain autograd's plan of ``jg``: the one argument of
    every policy kind's planner (``_PLANNERS``)."""

    jg: JointGraph
    policy: Policy
    spent_bytes: int
    link: Link | None
    offload_min_bytes: int
    offload_limit_bytes: int | None
    share: GraphShare | None
    first_plan: bool
    headroom_bytes: int
    cache: FrontierCache | None
    least_kept: bool
    #: plain autograd's kept set and its simulation
    baseline: set[fx.Node]
    base_sim: StepSimulation
    #: each node's modelled seconds, which offload hides transfers behind (empty without offload)
    seconds: dict[fx.Node, float]

    def frontier_points(self) -> list[Candidate]:
        """The graph's frontier, with offload plans added when the policy offloads."""
        offload, cache = self.policy.offload, self.cache
        if cache is not None and offload in cache.points:
            return cache.points[offload]
        points = pareto_frontier(self.jg)
        if offload:
            assert self.link is not None
            points = with_offload(
                self.jg,
                points,
                self.link,
                self.seconds,
                min_bytes=self.offload_min_bytes,
                limit_bytes=self.offload_limit_bytes,
            )
        if cache is not None:
            cache.points[offload] = points
        return points


@dataclasses.dataclass
class _Chosen:
    """What a policy kind's planner chose: the kept set, its simulation and transfers, and what
    the plan reports beside them."""

    kept: set[fx.Node]
    sim: StepSimulation
    schedule: TransferSchedule | None = None
    note: str = ""
    budget_bytes: int | None = None
    frontier: tuple[FrontierPoint, ...] = ()


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
    (``planning.plan_chain``) for which ``"memory"`` keeps the least it can (``least_kept_point``).
    """
    if cache is not None and cache.jg is not jg:
        raise ValueError("plan_graph: the frontier cache belongs to another graph")
    if policy.offload and link is None:
        raise ValueError(f"policy {policy.label!r} offloads: plan_graph needs the link's bandwidth")
    baseline = keep_all(jg)
    request = _Request(
        jg,
        policy,
        spent_bytes,
        link,
        offload_min_bytes,
        offload_limit_bytes,
        share,
        first_plan,
        headroom_bytes,
        cache,
        least_kept,
        baseline=baseline,
        base_sim=simulate_step(jg, baseline),
        seconds={n: node_seconds(n, jg.sizes) for n in jg.nodes} if policy.offload else {},
    )
    chosen = _never_worse_than_none(request, _PLANNERS[policy.name](request))
    return describe_plan(
        jg,
        policy,
        chosen.kept,
        chosen.sim,
        request.base_sim,
        baseline,
        note=chosen.note,
        budget_bytes=chosen.budget_bytes,
        frontier=chosen.frontier,
        schedule=chosen.schedule if chosen.schedule and chosen.schedule.transfers else None,
        offload_to=offload_to,
        step_budget_bytes=share.step_budget_bytes if share else None,
    )


def _never_worse_than_none(request: _Request, chosen: _Chosen) -> _Chosen:
    """``chosen``, or plain autograd's plan where ``chosen`` would peak above it under a policy that
    must never do so. A graph of a chain is judged by the step's peak (``planning.plan_chain``), not
    by its own."""
    base_sim = request.base_sim
    if (
        not request.policy.never_worse_than_none
        or request.least_kept
        or chosen.sim.peak_bytes <= base_sim.peak_bytes
    ):
        return chosen
    note = (
        f"{request.policy.name!r} would peak above plain autograd here "
        f"({chosen.sim.peak_bytes} > {base_sim.peak_bytes} B): kept everything instead"
    )
    return _Chosen(request.baseline, base_sim, None, note, chosen.budget_bytes, chosen.frontier)


def _plan_budget(request: _Request) -> _Chosen:
    """A budget: the cheapest frontier point within it (less what earlier graphs keep and the
    executor's headroom), or, while the step is not yet checked as a whole, the least peak."""
    jg, share = request.jg, request.share
    points = request.frontier_points()
    frontier = _frontier(jg, points)
    budget = request.policy.budget
    assert budget is not None
    fraction = budget.fraction if share is None else None
    if share is not None:
        budget_bytes = share.peak_bytes
        allowed_points = [p for p, q in zip(points, frontier) if q.kept_bytes <= share.kept_bytes]
    else:
        budget_bytes = budget.resolve(
            request.base_sim.peak_bytes, _activation_bytes(jg, request.baseline)
        )
        allowed_points = points
    if fraction is not None:
        budget_bytes = _fraction_reach(jg, points, fraction, budget_bytes)
    # A fraction is of this graph's own activations; bytes are shared with earlier graphs.
    allowed = budget_bytes if fraction is not None or share else budget_bytes - request.spent_bytes
    allowed -= request.headroom_bytes
    try:
        chosen = choose(allowed_points or points, allowed)
        note = ""
    except BudgetError as err:
        if not (
            share is not None
            or (request.first_plan and (fraction is not None or request.spent_bytes))
        ):
            raise _budget_error(request, err, fraction) from None
        chosen = min(points, key=lambda p: (p.peak_bytes, p.cost_seconds))
        note = f"{err}; planned at its least peak until the step is checked as a whole"
    return _Chosen(
        set(chosen.kept), chosen.simulation, chosen.schedule, note, budget_bytes, frontier
    )


def _frontier(jg: JointGraph, points: list[Candidate]) -> tuple[FrontierPoint, ...]:
    """The frontier as the plan reports it."""
    return tuple(
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


def _budget_error(request: _Request, err: BudgetError, fraction: float | None) -> BudgetError:
    """``err`` with the reason the budget could not be met, where the request tells one."""
    jg = request.jg
    if request.policy.offload and request.offload_limit_bytes is not None:
        return _explained(
            err,
            f"offload was limited to {format_bytes(request.offload_limit_bytes)} per step by the "
            f"host budget or the free space of the offload disk",
        )
    if jg.outside_bytes:
        return _explained(
            err,
            f"including {format_bytes(jg.outside_bytes)} the step was measured to hold "
            f"outside memfit's graphs between forward and backward, e.g. a loss computed "
            f"outside the model; memfit.step plans the loss too",
        )
    if request.spent_bytes and fraction is None:
        return _explained(
            err,
            f"{request.spent_bytes} bytes of the budget are already kept by earlier graphs of "
            f"this step: the model has graph breaks",
        )
    if not request.policy.offload and not request.policy.swaps:
        return _explained(
            err,
            "to go lower: offload=True lets the plan move saved activations to host memory "
            "(to disk on CPU) at the cost of the transfers, or train a smaller batch",
        )
    return _explained(err, "to go lower: train a smaller batch, or give the step more memory")


def _plan_least_memory(request: _Request) -> _Chosen:
    """``"memory"``: the least peak on the frontier. The cut heuristic ("keep_min_peak") is one
    of its candidates, and the segment programme often finds a lower peak for less recompute.
    Under Inductor, the cheapest within the frontier's gap of it; in a chain of graphs, the point
    that keeps the least."""
    jg = request.jg
    points = request.frontier_points()
    if request.least_kept:
        lowest = least_kept_point(jg, points)
    else:
        lowest = least_peak_point(
            points, request.base_sim.peak_bytes, estimate=jg.fused_elementwise
        )
    return _Chosen(set(lowest.kept), lowest.simulation, lowest.schedule)


def _plan_swap(request: _Request) -> _Chosen:
    """``"swap"``: keep everything, recompute nothing, offload what hides behind compute."""
    assert request.link is not None
    swapped = swap(
        request.jg,
        request.baseline,
        request.base_sim,
        request.link,
        request.seconds,
        min_bytes=request.offload_min_bytes,
        limit_bytes=request.offload_limit_bytes,
    )
    return _Chosen(set(request.baseline), swapped.simulation, swapped.schedule)


def _keep_heavy_fused(jg: JointGraph) -> set[fx.Node]:
    """``"speed"``'s rule. Under Inductor, "recompute only cheap ops" includes what fuses into
    the backward's kernels (``planning.fusion``), as torch.compile's partitioner does."""
    kept = keep_heavy(jg)
    return fused_plan(jg, kept) if jg.fused_elementwise else kept


def _keeping(rule: Callable[[JointGraph], set[fx.Node]]) -> Callable[[_Request], _Chosen]:
    """The planner of a policy answered by one keep-set rule."""

    def plan(request: _Request) -> _Chosen:
        kept = rule(request.jg)
        return _Chosen(kept, simulate_step(request.jg, kept))

    return plan


#: How each policy kind plans, by the policy's name: the planner's one dispatch on it.
_PLANNERS: dict[str, Callable[[_Request], _Chosen]] = {
    BUDGET: _plan_budget,
    "memory": _plan_least_memory,
    "swap": _plan_swap,
    "none": _keeping(keep_all),
    "speed": _keeping(_keep_heavy_fused),
    "collection": _keeping(keep_marked),
}


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
