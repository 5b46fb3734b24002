"""The ``torch.compile`` backend that applies memfit plans.

Dynamo captures each graph-break-free piece of the model; AOTAutograd traces its joint
forward/backward graph and hands it to ``partition``, where memfit prepares it
(``capture.passes``), measures its ops' scratch memory, plans it and splits it by the plan. The
order is the point: every rewrite that changes what can be decided runs before analysis, so the
plan describes exactly the graphs that run and nothing is patched afterwards.

How the split graphs then run is ``execution.runners``; under ``executor="inductor"`` a plan
is compiled and fitted to its budget by ``execution.inductor_fit``.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from memfit._compat import (
    aot_autograd,
    disable_current_modes,
)
from memfit.analysis.backward_start import (
    BackwardStart,
    assumed_start,
    returns_loss,
    start_of,
)
from memfit.analysis.graph import JointGraph, node_tensors
from memfit.analysis.op_scratch import measure_op_scratch
from memfit.analysis.transfers import Link
from memfit.capture.attention import ATTENTION_MODES, AttentionSite, replace_attention
from memfit.capture.dropout import remove_identity_dropouts
from memfit.capture.passes import prepare_joint_graph
from memfit.execution.executors import (
    EAGER,
    INDUCTOR,
    check_executor,
    decompositions,
)
from memfit.execution.inductor_fit import (
    SCHEDULE_TRIES,
    SYMBOLIC_BUDGET_WARNING,
    fit_schedule,
    largest_value,
    reached_fraction,
)
from memfit.execution.offload import OffloadOptions, OffloadStore, copy_overlap, measure_link
from memfit.execution.partition import split_joint_graph
from memfit.execution.runners import (
    PLAN_META,
    SIZES_META,
    USER_OUTPUTS_META,
    WATCH_META,
    Shared,
    boxed,
    boxed_backward,
    boxed_forward,
)
from memfit.execution.start_watch import StartWatch
from memfit.execution.symbolic import PlansBySize, capture_sizes
from memfit.measurement.cpu import cpu_recording_blocked
from memfit.planning.budget import Budget, BudgetError
from memfit.planning.plan import GraphPlan, sized_key
from memfit.planning.planner import FrontierCache, plan_graph
from memfit.planning.policy import BUDGET, Policy
from memfit.planning.step import GraphShare
from memfit.units import format_bytes
from memfit.warn import warn_user

__all__ = ["make_backend", "Offloader", "StepBudget"]


def graph_key(gm: fx.GraphModule, example_inputs: Any) -> str:
    """A name for a Dynamo graph and its inputs' shapes, the same each time it is captured.

    Where a size is a symbol, the key has the symbol, not the size of the call captured: a graph
    captured again for another range of sizes (after planning again) keeps its name, and with it
    what was measured while its previous capture ran.
    """
    parts = [gm.code]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    examples = [n.meta.get("example_value") for n in placeholders]
    if len(examples) == len(example_inputs) and all(e is not None for e in examples):
        example_inputs = examples  # fake values: symbolic sizes as symbols
    for t in example_inputs:
        if isinstance(t, torch.Tensor):
            parts.append(f"{t.dtype}{tuple(t.shape)}{t.stride()}{t.device}{t.requires_grad}")
        else:
            parts.append(repr(t))
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:16]


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
class StepBudget:
    """What the graphs of one training step have kept so far, for a byte budget shared by them.

    With graph breaks, the graphs of one step are planned one after the other as the step first
    runs; values kept by earlier graphs stay alive while later ones run, so each graph gets the
    budget less what the graphs that ran before it in this step keep (counted as each graph's
    forward runs, so a graph compiled in an earlier step counts too). The wrapper resets
    ``spent`` at every call.
    """

    spent: int = 0


class Offloader:
    """The offload side of one wrapper: its options, its stores and the link it plans with.

    A store is made when the first graph offloading to its destination is planned (the
    destination depends on the device the activations are on) and lives as long as the wrapper;
    graphs of one model on different devices each keep theirs. ``spent`` is what the graphs of
    the current step offload, so the host budget and the disk's free space bound the step, not
    each graph (the wrapper resets it at every call, as it does the step budget).
    """

    def __init__(self, options: OffloadOptions) -> None:
        self.options = options
        self.stores: dict[str, OffloadStore] = {}
        self.store: OffloadStore | None = None  # the store of the graph planned last
        self.spent = 0

    def prepare(self, jg: JointGraph) -> tuple[Link, str, int | None]:
        """The link, destination and byte limit the planner offloads ``jg``'s values with."""
        device = _activation_device(jg)
        to = self.options.destination(device)
        if to not in self.stores:
            self.stores[to] = OffloadStore(to, self.options.directory)
        self.store = self.stores[to]
        limits = [self.options.host_budget_bytes]
        free = self.store.free_disk_bytes()
        if free is not None:
            limits.append(int(0.9 * free))
        limit = min((n for n in limits if n is not None), default=None)
        if limit is not None:
            limit = max(limit - self.spent, 0)
        if self.options.bandwidth is not None:
            bandwidth = self.options.bandwidth
            return Link(bandwidth, bandwidth, overlap=copy_overlap(device)), to, limit
        with disable_current_modes():  # the partitioner traces under fake tensors: measure real
            return measure_link(to, device, self.options.directory), to, limit

    def reserve(self, plan: GraphPlan) -> None:
        """Hold host memory for ``plan``'s offload (counted against the step when it runs)."""
        if not plan.transfers or self.store is None:
            return
        with disable_current_modes():  # a real pinned arena, not a fake tensor
            self.store.reserve([t.nbytes for t in plan.transfers])


def _activation_device(jg: JointGraph) -> torch.device:
    for n in jg.forward:
        for t in node_tensors(n):
            return t.device
    return torch.device("cpu")


def make_backend(
    policy: Policy,
    on_plan: Callable[[GraphPlan], None],
    step_budget: StepBudget | None = None,
    attention: str = "auto",
    offloader: Offloader | None = None,
    on_run: Callable[[GraphPlan], None] | None = None,
    on_backward: Callable[[GraphPlan], None] | None = None,
    outside_bytes: Callable[[str, int], int] | None = None,
    share: Callable[[str], GraphShare | None] | None = None,
    on_compile: Callable[[], None] | None = None,
    on_budget_miss: Callable[[GraphPlan], None] | None = None,
    executor: str = EAGER,
    on_unmeasured: Callable[[], None] | None = None,
    backward_start: Callable[[str], BackwardStart | None] | None = None,
    on_backward_start: Callable[[str, BackwardStart, bool], None] | None = None,
) -> Callable[..., Any]:
    """A Dynamo backend planning every joint graph with ``policy``; reports each plan.

    ``on_plan`` receives each graph's plan when it is made; ``on_run`` receives it every time
    the graph's forward runs afterwards, so a wrapper can say which plans the call it just made
    ran (Dynamo reuses a graph compiled earlier without calling the backend again), and
    ``on_backward`` every time its backward starts. ``outside_bytes(key, output_bytes)`` is what
    the step holds outside the graph ``key`` names (``GraphPlan.key``) between its forward and
    backward, when the graph's outputs take ``output_bytes``; the plan reserves it.
    ``share(key)``, once a step with graph breaks has been planned as a whole
    (``planning.step``), is the graph's share of the step's budget at the sizes ``key`` names
    (``GraphPlan.sized_key``); before that (None), each graph is planned as the step's first
    call reaches it. ``on_compile`` is called as Dynamo hands the backend a graph, before
    anything else (the wrapper looks at which modules are running eagerly then:
    ``execution.regions``).

    A graph captured with symbolic sizes (a dimension that varied between calls) is planned once
    at the sizes of the call captured, for the range of sizes its decisions hold for (guards of
    the capture: a size outside is captured again), and ``on_run`` receives, for every call,
    the plan at the sizes that call ran (NOTE [One capture for many sizes] in
    ``planning.resize``); ``on_budget_miss`` receives it where the budget does not hold at
    those sizes (between the sizes the range was checked at), for the wrapper to plan again.
    ``on_unmeasured`` is called where a graph compiled by Inductor could not be measured because
    a CPU profiler session was running (a ``memfit.measure`` around the first call): its peaks
    are then Inductor's schedule's estimate, and the wrapper plans again, measured, on its first
    call outside such a session.

    ``backward_start(key)`` is the start of the backward of graph ``key`` seen on an earlier
    step (which outputs the caller held, which got no gradient: ``analysis.backward_start``);
    None: it is assumed. ``on_backward_start(key, seen, material)`` receives, at each planned
    graph's first backward, the start seen there where it differs from the one planned for, and
    whether it differs by enough to plan again (``execution.start_watch``).

    With ``attention="auto"`` every attention in the Dynamo graph is first rewritten to a kernel
    that keeps no Lq x Lk tensor (``capture.attention``); the sites found are reported on the
    graph's plan. A policy that offloads needs an ``offloader``.
    """
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
    check_executor(executor)
    if policy.offload and offloader is None:
        offloader = Offloader(OffloadOptions())
    sites: list[AttentionSite] = []
    current_key = [""]
    #: the real values of the joint graph's primals for the graph being captured
    current_primals: list[list[Any] | None] = [None]

    def partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        prepare_joint_graph(joint, inductor=executor == INDUCTOR)
        jg = JointGraph(joint, kwargs["num_fwd_outputs"])
        jg.fused_elementwise = executor == INDUCTOR
        jg.op_scratch = measure_op_scratch(jg.nodes, min_bytes=largest_value(jg) // 64)
        key = current_key[0]
        outside: Callable[[int], int] | None = None
        if outside_bytes is not None:
            report_outside = outside_bytes

            def outside(output_bytes: int) -> int:
                return report_outside(key, output_bytes)

        jg.outside_bytes = outside(jg.bytes_of(jg.fwd_outputs)) if outside else 0
        seen = backward_start(key) if backward_start is not None else None
        jg.backward_start = seen if seen is not None else assumed_start(jg)
        jg.static_inputs = frozenset(kwargs.get("static_lifetime_input_indices") or ())
        link, to, limit = (
            offloader.prepare(jg) if policy.offload and offloader else (None, None, None)
        )
        graph_share = share(sized_key(key, capture_sizes(jg).key)) if share else None
        spent = step_budget.spent if step_budget else 0

        #: "memory"'s first plan's simulated peak: under Inductor a cheaper plan that peaks no
        #: higher once compiled is searched as a budget at that peak less ``headroom``
        least_simulated: list[int] = []
        frontier = FrontierCache(jg)  # every plan of this graph below reads one frontier
        #: a budget the simulation refused: "memory"'s plan is searched, then held to it
        refused: list[int] = []

        def plan(headroom: int = 0) -> GraphPlan:
            asked = policy
            if headroom and least_simulated:
                asked = Policy(BUDGET, budget=Budget(bytes=least_simulated[0]))
            graph_plan = plan_graph(
                jg,
                asked,
                spent_bytes=spent,
                share=graph_share,
                first_plan=graph_share is None,
                link=link,
                offload_to=to,
                offload_min_bytes=offloader.options.min_bytes if offloader else 1,
                offload_limit_bytes=limit,
                headroom_bytes=headroom,
                cache=frontier,
            )
            if asked is not policy:
                graph_plan = dataclasses.replace(
                    graph_plan,
                    policy=policy.name,
                    budget_bytes=refused[0] if refused else None,
                    frontier=(),
                )
            return dataclasses.replace(graph_plan, attention=tuple(sites), key=key)

        def refuse(budget_bytes: int) -> GraphPlan:
            """A budget refused (by the simulation, or by every plan compiled from it down):
            the plan "memory" would take, searched the same way, then held to the budget."""
            refused.append(budget_bytes)
            least = plan_graph(jg, Policy("memory"), cache=frontier)
            return dataclasses.replace(
                least, policy=BUDGET, budget_bytes=budget_bytes, attention=tuple(sites), key=key
            )

        def split(graph_plan: GraphPlan) -> tuple[fx.GraphModule, fx.GraphModule]:
            return split_joint_graph(
                joint,
                graph_plan,
                num_fwd_outputs=kwargs["num_fwd_outputs"],
                static_lifetime_input_indices=kwargs.get("static_lifetime_input_indices"),
                store=offloader.store if offloader else None,
                input_views_as_bases=executor == INDUCTOR,
            )

        measured_fit = executor == INDUCTOR and not policy.offload
        try:
            graph_plan = plan()
        except BudgetError as err:
            # Compiled by Inductor, the least-peak plan often peaks below its simulation (a
            # U-Net: 0.84x), so a budget the simulation refuses may still fit: measure it.
            if (
                not measured_fit
                or jg.symbols
                or graph_share is not None
                or spent
                or err.budget_bytes is None
            ):
                raise
            graph_plan = refuse(err.budget_bytes)
        if executor == INDUCTOR and jg.symbols and policy.budget is not None and not measured_fit:
            warn_user(SYMBOLIC_BUDGET_WARNING)
        fw: fx.GraphModule | None = None
        bw: fx.GraphModule | None = None
        measured = False  # whether the plan's peaks were measured once compiled
        if measured_fit:
            byte_budget = policy.budget is not None and policy.budget.fraction is None
            fraction = policy.budget.fraction if policy.budget is not None else None
            limit_bytes: int | None = None
            # A fraction whose bytes are a plan's simulated peak (see reached_fraction): held
            # to what that plan peaks at once compiled where that is higher.
            reached = (
                not refused
                and graph_share is None
                and not spent
                and reached_fraction(policy, graph_plan)
            )
            if not refused and policy.budget is not None and graph_plan.budget_bytes is not None:
                own = byte_budget and graph_share is None
                limit_bytes = graph_plan.budget_bytes - (spent if own else 0)
                if (
                    graph_plan.predicted_peak_bytes > limit_bytes
                    and graph_share is None
                    and not spent
                ):
                    # refused by the simulation after all (a fraction's first plan is its least
                    # peak then): as above
                    refused.append(limit_bytes)
                    limit_bytes = None
            at_least_peak_ok = graph_share is None and not spent
            at_least_peak = (policy.least_memory or bool(refused)) and at_least_peak_ok
            if at_least_peak:
                least_simulated.append(graph_plan.predicted_peak_bytes)
            reach_bytes = graph_plan.budget_bytes

            # With autotune, a budget the simulation met, for a graph planned on its own: its
            # cheapest plan is timed against "speed"'s where both fit once compiled (_faster);
            # not for a budget the simulation refused, whose plans are "memory"'s.
            timed_choice = policy.autotune and graph_share is None and not spent and not jg.symbols

            def speed_rival() -> GraphPlan:
                speed = plan_graph(jg, Policy("speed"))
                return dataclasses.replace(
                    speed,
                    policy=BUDGET,
                    budget_bytes=graph_plan.budget_bytes,
                    frontier=graph_plan.frontier,
                    attention=tuple(sites),
                    key=key,
                )

            def fit(
                graph_plan: GraphPlan, limit_bytes: int | None, at_least_peak: bool
            ) -> tuple[GraphPlan, fx.GraphModule, fx.GraphModule, bool, int | None]:
                # a refused budget: the plans are searched as "memory"'s, the one kept is within
                # the budget where one is
                return fit_schedule(
                    jg,
                    graph_plan,
                    plan,
                    split,
                    kwargs["num_fwd_outputs"],
                    limit_bytes,
                    current_primals[0],
                    strict=at_least_peak_ok,
                    at_least_peak=at_least_peak,
                    at_least_first=reached and limit_bytes is not None,
                    # A graph captured for a range of sizes: its first plan only (Inductor failed
                    # to compile other plans' symbolic graphs of a ResNet with a symbolic batch:
                    # "Cannot convert expression to float", 2.13.0)
                    tries=1 if jg.symbols else SCHEDULE_TRIES,
                    keep_within=refused[0] if refused else None,
                    rival=speed_rival if timed_choice and not refused else None,
                )

            try:
                graph_plan, fw, bw, measured, held_to = fit(graph_plan, limit_bytes, at_least_peak)
            except BudgetError as err:
                if refused or jg.symbols or err.budget_bytes is None or not at_least_peak_ok:
                    raise
                # The simulation accepted the budget, but no plan tried from there down fits
                # once compiled. The least peak to name is the one "memory" reaches, searched as
                # for a budget the simulation refuses: the plans tried went down from the
                # budget, and the least simulated plan can compile above one simulated higher
                # (the frontier's CPU transformer: 19.4 MiB against 16.6), so the least tried
                # need not be the least reachable.
                graph_plan = refuse(err.budget_bytes)
                least_simulated.append(graph_plan.predicted_peak_bytes)
                reached = False
                graph_plan, fw, bw, measured, held_to = fit(graph_plan, None, True)
            if (
                reached
                and reach_bytes is not None
                and held_to is not None
                and held_to > reach_bytes
            ):
                graph_plan = dataclasses.replace(
                    graph_plan,
                    budget_bytes=held_to,
                    note=(
                        f"{graph_plan.note}; plain autograd's peak less the activations the "
                        f"budget's fraction gives up is below every plan keeping that fraction: "
                        f"the budget is the least peak of such a plan, once compiled"
                    ),
                )
            if refused and graph_plan.predicted_peak_bytes > refused[0]:
                if fraction is None or not graph_plan.keeps_fraction(fraction):
                    least_peak = graph_plan.predicted_peak_bytes
                    raise BudgetError(
                        f"no plan fits: compiled by Inductor, the least peak of the plans tried "
                        f'(those of its "memory" search) is {format_bytes(least_peak)}, above the '
                        f"budget of {format_bytes(refused[0])} (measured once compiled; not every "
                        f"plan is compiled, and a plan simulated higher may compile lower); use a "
                        f"larger budget, or executor='eager', whose peaks are the simulation's",
                        budget_bytes=refused[0],
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
                        f"the activations the budget's fraction gives up ({refused[0]} B): the "
                        f"budget is the least peak of a plan keeping that fraction, once compiled"
                    ),
                )
        if (
            measured_fit
            and not measured
            and on_unmeasured is not None
            and _activation_device(jg).type == "cpu"
            and cpu_recording_blocked() is not None
        ):
            on_unmeasured()
        graph_plan = dataclasses.replace(graph_plan, returns_loss=returns_loss(jg))
        if seen is not None:  # planned again for what earlier steps' backwards showed
            said = f"planned for the backward start seen on earlier steps: {seen.describe()}"
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
                outside,
                spent_bytes=spent,
                shared=graph_share is not None,
                compiled=measured,
            )
            graph_plan = by_size.planned
        on_plan(graph_plan)
        if fw is None or bw is None:
            if offloader is not None:
                offloader.reserve(graph_plan)
            fw, bw = split(graph_plan)
        # AOTAutograd compiles the backward lazily, at its first run, possibly after other
        # graphs were planned: each graph carries its plan in its metadata.
        fw.meta[PLAN_META] = bw.meta[PLAN_META] = graph_plan
        if on_backward_start is not None:
            fw.meta[WATCH_META] = bw.meta[WATCH_META] = Shared(
                _start_watch(jg, graph_plan, key, on_backward_start)
            )
        fw.meta[USER_OUTPUTS_META] = kwargs["num_fwd_outputs"]
        if by_size is not None:
            fw.meta[SIZES_META] = by_size
        return fw, bw

    def compile_forward(gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        planned: GraphPlan | None = gm.meta.get(PLAN_META)
        if planned is None:  # not partitioned by memfit: no plan to report
            return boxed_forward(gm, example_inputs, executor=executor)
        plan: GraphPlan = planned
        by_size: PlansBySize | None = gm.meta.get(SIZES_META)
        read_sizes = by_size.reader(gm) if by_size is not None else None

        def ran(args: list[Any]) -> None:
            this = plan
            if by_size is not None and read_sizes is not None:
                this = by_size.at(read_sizes(args))
                spent = step_budget.spent if step_budget is not None else 0
                if on_budget_miss is not None and by_size.over_budget(this, spent_bytes=spent):
                    on_budget_miss(this)
            # What this graph keeps (and offloads) is alive while the step's later graphs run.
            if step_budget is not None:
                step_budget.spent += this.kept_bytes
            if offloader is not None and this.transfers:
                offloader.spent += this.offloaded_bytes
            if on_run is not None:
                on_run(this)

        return boxed_forward(gm, example_inputs, on_run=ran, executor=executor)

    def compile_backward(gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        planned: GraphPlan | None = gm.meta.get(PLAN_META)
        if planned is None or on_backward is None:
            return boxed_backward(gm, example_inputs, executor=executor)
        plan: GraphPlan = planned
        report = on_backward
        return boxed_backward(
            gm, example_inputs, on_run=lambda args: report(plan), executor=executor
        )

    def compile_inference(gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        return boxed(gm, example_inputs, executor=executor)

    compile_joint = aot_autograd(
        fw_compiler=compile_forward,
        bw_compiler=compile_backward,
        inference_compiler=compile_inference,
        partition_fn=partition,
        decompositions=decompositions(executor),
        # Under Inductor, as torch.compile's own AOTAutograd call (compile_fx, checked 2.13.0):
        # an input the forward writes (BatchNorm's running statistics) is written inside the
        # compiled graph, fused into the kernel that computes it, instead of being returned and
        # copied back by AOTAutograd's wrapper: on the frontier's ResNet, 75 fewer buffers and
        # 75 fewer copy_ calls per step. The eager executor keeps eager's ops as they are.
        keep_inference_input_mutations=executor == INDUCTOR,
    )

    def backend(gm: fx.GraphModule, example_inputs: Any) -> Any:
        if on_compile is not None:
            on_compile()
        sites.clear()
        current_key[0] = graph_key(gm, example_inputs)
        # AOTAutograd's primals: the module's parameters and buffers, then Dynamo's inputs
        # (aot_module_simplified, checked 2.13.0); real values, which the Inductor executor runs
        # its compiled graphs on once to measure them.
        current_primals[0] = [
            *dict(gm.named_parameters(remove_duplicate=False)).values(),
            *dict(gm.named_buffers(remove_duplicate=False)).values(),
            *example_inputs,
        ]
        remove_identity_dropouts(gm)  # eager makes no copy for them; AOTAutograd would
        if attention == "auto":
            sites.extend(replace_attention(gm))
        return compile_joint(gm, example_inputs)

    return backend
