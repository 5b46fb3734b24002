"""memfit's AOTAutograd partition function: a joint graph analysed, planned and split.

AOTAutograd hands ``Partitioner`` the joint forward/backward graph of each Dynamo graph. It
prepares the graph (``capture.passes``), measures its ops' scratch memory, plans it against what
the step around it holds (what earlier graphs of the step keep, the graph's share of a step
planned as a whole, what the caller holds outside it) and splits it by the plan
(``execution.split``). Under ``executor="inductor"`` the plan is compiled, measured and
fitted to its budget (``execution.inductor_fit``): a budget the simulation refuses may still fit
once compiled, and one it accepts may not.

A ``Partitioner`` lives as long as its backend, which tells it the Dynamo graph being captured.
What one joint graph is planned against, and what planning it learns (a budget refused, the least
peak simulated), is a ``_Partition``: made as AOTAutograd hands the graph over, dropped once it
is split.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

import torch.fx as fx

from memfit._compat import is_fake
from memfit.analysis.backward_start import assumed_start, returns_loss, start_of
from memfit.analysis.graph import BackwardStart, JointGraph, activation_device
from memfit.analysis.op_scratch import measure_op_memory, modelled_op_scratch
from memfit.analysis.transfers import Link
from memfit.capture.attention import AttentionSite
from memfit.capture.loss_head import LossHeadSite
from memfit.capture.passes import prepare_joint_graph
from memfit.execution.events import BackendEvents
from memfit.execution.executors import INDUCTOR
from memfit.execution.fake_target import planning_target
from memfit.execution.inductor_fit import (
    SCHEDULE_TRIES,
    SYMBOLIC_BUDGET_WARNING,
    fit_schedule,
    largest_value,
    reached_fraction,
)
from memfit.execution.runners import (
    PLAN_META,
    SIZES_META,
    USER_OUTPUTS_META,
    WATCH_META,
    Shared,
)
from memfit.execution.settings import BackendSettings, StepBudget
from memfit.execution.split import split_joint_graph
from memfit.execution.start_watch import StartWatch
from memfit.execution.symbolic import PlansBySize, capture_sizes
from memfit.measurement.cpu import cpu_recording_blocked
from memfit.planning.budget import Budget, BudgetError
from memfit.planning.plan import GraphPlan, sized_key
from memfit.planning.planner import FrontierCache, plan_graph
from memfit.planning.policy import BUDGET, Policy
from memfit.planning.step_budget import GraphShare
from memfit.units import format_bytes
from memfit.warn import warn_user

__all__ = ["Partitioner", "StepBudget"]

#: How the graphs of a budget the step's chain holds are planned (``BackendEvents.chain_mode``).
MEMORY = Policy("memory")


def _start_watch(
    jg: JointGraph,
    plan: GraphPlan,
    key: str,
    report: Callable[[str, BackwardStart, bool], None],
) -> StartWatch:
    """A watch of the first backward of the graph planned as ``plan``, reporting for ``key``."""
    nbytes = {n.name: jg.bytes_of([n]) for n in (*jg.fwd_outputs, *jg.tangents)}
    return StartWatch(
        start_of(jg),
        nbytes,
        plan.predicted_peak_bytes,
        lambda seen, material: report(key, seen, material),
    )


@dataclasses.dataclass
class _Partition:
    """One joint graph being partitioned, what its plans are made against, what planning it
    learns; lives for one call of the partitioner."""

    joint: fx.GraphModule
    jg: JointGraph
    #: AOTAutograd's: how many forward outputs are the user's, which inputs live as the module
    num_fwd_outputs: int
    static_lifetime_input_indices: Any
    key: str  # the Dynamo graph's name (backend.graph_key)
    #: what the step holds outside the graph from forward to backward, given its outputs' bytes
    outside: Callable[[int], int] | None
    seen: BackwardStart | None  # the backward start seen on an earlier step (None: assumed)
    #: what the planner offloads over, to where, and at most how much (None: no offload)
    link: Link | None
    offload_to: str | None
    offload_limit: int | None
    #: the graph's share of a step planned as a whole (None: planned as the step reaches it)
    share: GraphShare | None
    spent: int  # what earlier graphs of this step keep
    frontier: FrontierCache  # every plan of this graph reads one frontier
    #: a budget the simulation refused: "memory"'s plan is searched, then held to it
    refused: int | None = None
    #: "memory"'s first plan's simulated peak: under Inductor a cheaper plan that peaks no
    #: higher once compiled is searched as a budget at that peak less ``headroom``
    least_simulated: int | None = None

    @property
    def alone(self) -> bool:
        """Whether the graph is planned on its own: no share of a step, nothing kept before it."""
        return self.share is None and not self.spent


# One backend's state: compared by identity, and a repr that does not print the primals it holds
@dataclasses.dataclass(eq=False, repr=False)
class Partitioner:
    """AOTAutograd's ``partition_fn`` for one backend: each joint graph planned with the
    settings' policy and split by its plan, the call told and asked through ``events``."""

    #: the one object holding the policy, executor and offloader (``execution.settings``)
    settings: BackendSettings
    #: what the partitioner asks of the call and reports to it (``execution.events``)
    events: BackendEvents
    # The Dynamo graph being captured, set by the backend as Dynamo hands it over and read as
    # AOTAutograd partitions its joint graph:
    #: its name (``backend.graph_key``)
    key: str = ""
    #: the attention sites rewritten in it, reported on its plan
    sites: list[AttentionSite] = dataclasses.field(default_factory=list)
    #: the loss heads found in it (rewritten or not), reported on its plan
    loss_heads: list[LossHeadSite] = dataclasses.field(default_factory=list)
    #: the real values of the joint graph's primals for the graph being captured
    primals: list[Any] | None = None

    @property
    def fake(self) -> bool:
        """Whether the model is planned on fake tensors (``execution.fake_target``): its
        parameters, buffers or inputs are fake, so nothing of it can run for real."""
        return any(is_fake(p) for p in self.primals or ())

    def __call__(
        self, joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        """``joint`` prepared, analysed, planned and split: its forward and backward graphs,
        each carrying the plan in its metadata."""
        g = self.analyse(joint, kwargs)
        jg, policy, inductor = g.jg, self.settings.policy, self.settings.executor == INDUCTOR
        measured_fit = inductor and not policy.offload
        try:
            graph_plan = self.plan(g)
        except BudgetError as err:
            # Compiled by Inductor, the least-peak plan often peaks below its simulation (a
            # U-Net: 0.84x), so a budget the simulation refuses may still fit: measure it.
            if not measured_fit or jg.symbols or not g.alone or err.budget_bytes is None:
                raise
            graph_plan = self.refuse(g, err.budget_bytes)
        if inductor and jg.symbols and policy.budget is not None and not measured_fit:
            warn_user(SYMBOLIC_BUDGET_WARNING)
        fw: fx.GraphModule | None = None
        bw: fx.GraphModule | None = None
        measured = False  # whether the plan's peaks were measured once compiled
        if measured_fit:
            graph_plan, fw, bw, measured = self.fit_measured(g, graph_plan)
        if (
            measured_fit
            and not measured
            and activation_device(jg).type == "cpu"
            and cpu_recording_blocked() is not None
        ):
            self.events.unmeasured()
        graph_plan = dataclasses.replace(graph_plan, returns_loss=returns_loss(jg))
        if g.seen is not None:  # planned again for what earlier steps' backwards showed
            said = f"planned for how earlier steps used the outputs: {g.seen.describe()}"
            note = f"{graph_plan.note}; {said}" if graph_plan.note else said
            graph_plan = dataclasses.replace(graph_plan, note=note)
        by_size: PlansBySize | None = None
        if jg.symbols:
            # A measured plan's other sizes move the simulation by what its compiled graphs held
            # beyond it (planning.resize); not from Inductor's schedule, which can be low (an
            # MLP: 1.21x at 2.5 times the batch captured).
            by_size = PlansBySize(
                jg,
                graph_plan,
                policy,
                g.outside,
                spent_bytes=g.spent,
                shared=g.share is not None,
                compiled=measured,
            )
            graph_plan = by_size.planned
        self.events.plan_made(graph_plan)
        offloader = self.settings.offloader
        if fw is None or bw is None:
            if offloader is not None and not self.fake:  # a fake plan never runs a step
                offloader.reserve(graph_plan)
            fw, bw = self.split(g, graph_plan)
        # AOTAutograd compiles the backward lazily, at its first run, possibly after other
        # graphs were planned: each graph carries its plan in its metadata.
        fw.meta[PLAN_META] = bw.meta[PLAN_META] = graph_plan
        fw.meta[WATCH_META] = bw.meta[WATCH_META] = Shared(
            _start_watch(jg, graph_plan, g.key, self.events.backward_start_seen)
        )
        fw.meta[USER_OUTPUTS_META] = g.num_fwd_outputs
        if by_size is not None:
            fw.meta[SIZES_META] = by_size
        return fw, bw

    def analyse(self, joint: fx.GraphModule, kwargs: dict[str, Any]) -> _Partition:
        """``joint`` prepared and analysed, with what its plans are made against."""
        settings, events = self.settings, self.events
        executor, policy, offloader = settings.executor, settings.policy, settings.offloader
        prepare_joint_graph(joint, inductor=executor == INDUCTOR)
        jg = JointGraph(joint, kwargs["num_fwd_outputs"])
        jg.fused_elementwise = executor == INDUCTOR
        min_bytes = largest_value(jg) // 64
        if self.fake:
            # A model planned on fake tensors has nothing real to run an op on: bytes as the
            # target's allocator takes them, its ops' scratch modelled for it (NOTE [Op scratch
            # on fake tensors]).
            target = planning_target() or activation_device(jg)
            jg.place_on(target)
            jg.op_scratch = modelled_op_scratch(jg.nodes, min_bytes=min_bytes, device=target)
        else:
            ops = measure_op_memory(jg.nodes, min_bytes=min_bytes)
            jg.op_scratch = ops.scratch
            jg.hold_outputs(ops.outputs)
        key = self.key
        outside = partial(events.outside_bytes, key)
        jg.outside_bytes = outside(jg.bytes_of(jg.fwd_outputs))
        seen = events.backward_start(key)
        jg.backward_start = seen if seen is not None else assumed_start(jg)
        jg.static_inputs = frozenset(kwargs.get("static_lifetime_input_indices") or ())
        link, to, limit = (
            offloader.prepare(jg) if policy.offload and offloader else (None, None, None)
        )
        graph_share = events.share(sized_key(key, capture_sizes(jg).key))
        spent = settings.step_budget.spent if settings.step_budget else 0
        return _Partition(
            joint,
            jg,
            num_fwd_outputs=kwargs["num_fwd_outputs"],
            static_lifetime_input_indices=kwargs.get("static_lifetime_input_indices"),
            key=key,
            outside=outside,
            seen=seen,
            link=link,
            offload_to=to,
            offload_limit=limit,
            share=graph_share,
            spent=spent,
            frontier=FrontierCache(jg),
        )

    def plan(self, g: _Partition, headroom: int = 0) -> GraphPlan:
        """``g``'s plan under the policy, ``headroom`` bytes below its budget (under Inductor,
        what a compiled plan peaked above its simulation)."""
        policy, offloader = self.settings.policy, self.settings.offloader
        asked = policy
        if headroom and g.least_simulated is not None:
            asked = Policy(BUDGET, budget=Budget(bytes=g.least_simulated))
        chained = self.events.chain_mode()
        held_by_chain = chained is not None and chained[1] is not None
        if held_by_chain:
            asked = MEMORY
        graph_plan = plan_graph(
            g.jg,
            asked,
            spent_bytes=g.spent,
            share=g.share,
            first_plan=g.share is None,
            link=g.link,
            offload_to=g.offload_to,
            offload_min_bytes=offloader.options.offload_min_bytes if offloader else 1,
            offload_limit_bytes=g.offload_limit,
            headroom_bytes=headroom,
            cache=g.frontier,
            least_kept=chained is not None and chained[0],
        )
        if held_by_chain:
            assert chained is not None
            graph_plan = dataclasses.replace(
                graph_plan,
                policy=policy.name,
                budget_bytes=chained[1],
                step_budget_bytes=chained[1],
            )
        elif asked is not policy:
            graph_plan = dataclasses.replace(
                graph_plan,
                policy=policy.name,
                budget_bytes=g.refused,
                frontier=(),
            )
        return dataclasses.replace(
            graph_plan, attention=tuple(self.sites), loss_heads=tuple(self.loss_heads), key=g.key
        )

    def refuse(self, g: _Partition, budget_bytes: int) -> GraphPlan:
        """A budget refused (by the simulation, or by every plan compiled from it down):
        the plan "memory" would take, searched the same way, then held to the budget."""
        g.refused = budget_bytes
        least = plan_graph(g.jg, Policy("memory"), cache=g.frontier)
        return dataclasses.replace(
            least,
            policy=BUDGET,
            budget_bytes=budget_bytes,
            attention=tuple(self.sites),
            loss_heads=tuple(self.loss_heads),
            key=g.key,
        )

    def split(self, g: _Partition, graph_plan: GraphPlan) -> tuple[fx.GraphModule, fx.GraphModule]:
        """``g``'s joint graph split into forward and backward graphs by ``graph_plan``."""
        return split_joint_graph(
            g.joint,
            graph_plan,
            num_fwd_outputs=g.num_fwd_outputs,
            static_lifetime_input_indices=g.static_lifetime_input_indices,
            store=self.settings.offloader.store if self.settings.offloader else None,
            input_views_as_bases=self.settings.executor == INDUCTOR,
            missing_tangents=start_of(g.jg).missing,
        )

    def speed_rival(self, g: _Partition, budget_plan: GraphPlan) -> GraphPlan:
        """``"speed"``'s plan of ``g``, as ``budget_plan``'s rival (autotune), for its budget."""
        speed = plan_graph(g.jg, Policy("speed"))
        return dataclasses.replace(
            speed,
            policy=BUDGET,
            budget_bytes=budget_plan.budget_bytes,
            frontier=budget_plan.frontier,
            attention=tuple(self.sites),
            loss_heads=tuple(self.loss_heads),
            key=g.key,
        )

    def fit(
        self,
        g: _Partition,
        graph_plan: GraphPlan,
        limit_bytes: int | None,
        at_least_peak: bool,
        *,
        at_least_first: bool,
        rival: Callable[[], GraphPlan] | None,
    ) -> tuple[GraphPlan, fx.GraphModule, fx.GraphModule, bool, int | None]:
        """``graph_plan`` compiled by Inductor and planned again while over ``limit_bytes``
        (``fit_schedule``)."""
        return fit_schedule(
            g.jg,
            graph_plan,
            partial(self.plan, g),
            partial(self.split, g),
            g.num_fwd_outputs,
            limit_bytes,
            self.primals,
            strict=g.alone,
            at_least_peak=at_least_peak,
            at_least_first=at_least_first,
            # A graph captured for a range of sizes: its first plan only (Inductor failed
            # to compile other plans' symbolic graphs of a ResNet with a symbolic batch:
            # "Cannot convert expression to float", 2.13.0)
            tries=1 if g.jg.symbols else SCHEDULE_TRIES,
            # a refused budget: the plans are searched as "memory"'s, the one kept is within
            # the budget where one is
            keep_within=g.refused,
            rival=rival,
        )

    def fit_measured(
        self, g: _Partition, graph_plan: GraphPlan
    ) -> tuple[GraphPlan, fx.GraphModule, fx.GraphModule, bool]:
        """Under ``executor="inductor"``, ``graph_plan`` fitted to the budget as compiled: the
        plan kept, its compiled forward and backward, and whether its peaks were measured."""
        policy = self.settings.policy
        byte_budget = policy.budget is not None and policy.budget.fraction is None
        fraction = policy.budget.fraction if policy.budget is not None else None
        limit_bytes: int | None = None
        # A fraction whose bytes are a plan's simulated peak (see reached_fraction): held
        # to what that plan peaks at once compiled where that is higher.
        reached = g.refused is None and g.alone and reached_fraction(policy, graph_plan)
        if g.refused is None and policy.budget is not None and graph_plan.budget_bytes is not None:
            own = byte_budget and g.share is None
            limit_bytes = graph_plan.budget_bytes - (g.spent if own else 0)
            if graph_plan.predicted_peak_bytes > limit_bytes and g.alone:
                # refused by the simulation after all (a fraction's first plan is its least
                # peak then): as in __call__
                g.refused = limit_bytes
                limit_bytes = None
        at_least_peak = (policy.least_memory or g.refused is not None) and g.alone
        if at_least_peak:
            g.least_simulated = graph_plan.predicted_peak_bytes
        reach_bytes = graph_plan.budget_bytes

        # With autotune, a budget the simulation met, for a graph planned on its own: its
        # cheapest plan is timed against "speed"'s where both fit once compiled (_faster);
        # not for a budget the simulation refused, whose plans are "memory"'s.
        timed_choice = policy.autotune and g.alone and not g.jg.symbols
        rival = (
            partial(self.speed_rival, g, graph_plan) if timed_choice and g.refused is None else None
        )
        try:
            graph_plan, fw, bw, measured, held_to = self.fit(
                g,
                graph_plan,
                limit_bytes,
                at_least_peak,
                at_least_first=reached and limit_bytes is not None,
                rival=rival,
            )
        except BudgetError as err:
            if g.refused is not None or g.jg.symbols or err.budget_bytes is None or not g.alone:
                raise
            # The simulation accepted the budget, but no plan tried from there down fits
            # once compiled. The least peak to name is the one "memory" reaches, searched as
            # for a budget the simulation refuses: the plans tried went down from the
            # budget, and the least simulated plan can compile above one simulated higher
            # (the frontier's CPU transformer: 19.4 MiB against 16.6), so the least tried
            # need not be the least reachable.
            graph_plan = self.refuse(g, err.budget_bytes)
            if g.least_simulated is None:  # "memory"'s first plan's peak stays the one set
                g.least_simulated = graph_plan.predicted_peak_bytes
            reached = False
            graph_plan, fw, bw, measured, held_to = self.fit(
                g, graph_plan, None, True, at_least_first=False, rival=None
            )
        if reached and reach_bytes is not None and held_to is not None and held_to > reach_bytes:
            graph_plan = dataclasses.replace(
                graph_plan,
                budget_bytes=held_to,
                note=(
                    f"{graph_plan.note}; plain autograd's peak less the activations the "
                    f"budget's fraction gives up is below every plan keeping that fraction: "
                    f"the budget is the least peak of such a plan, once compiled"
                ),
            )
        if g.refused is not None and graph_plan.predicted_peak_bytes > g.refused:
            if fraction is None or not graph_plan.keeps_fraction(fraction):
                least_peak = graph_plan.predicted_peak_bytes
                raise BudgetError(
                    f"no plan fits: compiled by Inductor, the least peak of the plans tried "
                    f'(those of its "memory" search) is {format_bytes(least_peak)}, above the '
                    f"budget of {format_bytes(g.refused)} (measured once compiled; not every "
                    f"plan is compiled, and a plan simulated higher may compile lower); use a "
                    f"larger budget, or executor='eager', whose peaks are the simulation's",
                    budget_bytes=g.refused,
                    least_bytes=least_peak,
                )
            # A fraction is met whenever a plan keeps that share of the activations
            # (planner's _fraction_reach), at the least peak of such a plan where that is
            # above plain autograd's less the activations given up: so once compiled too.
            # Refused here, a larger fraction was refused where a smaller one, whose bytes
            # the simulation put below every plan, was met (the frontier's CPU transformer:
            # 0.25 refused naming 16.6 MiB, 0.2 met at it). (A refused budget is never a
            # graph's share of a step's: it was planned alone.)
            graph_plan = dataclasses.replace(
                graph_plan,
                budget_bytes=graph_plan.predicted_peak_bytes,
                note=(
                    f"{graph_plan.note}; no plan compiled within plain autograd's peak less "
                    f"the activations the budget's fraction gives up ({g.refused} B): the "
                    f"budget is the least peak of a plan keeping that fraction, once compiled"
                ),
            )
        return graph_plan, fw, bw, measured
