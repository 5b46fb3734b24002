"""The ``torch.compile`` backend that applies memfit plans.

Dynamo captures each graph-break-free piece of the model; AOTAutograd traces its joint
forward/backward graph and hands it to ``partition``, where memfit prepares it
(``capture.passes``), measures its ops' scratch memory, plans it and splits it by the plan. The
order is the point: every rewrite that changes what can be decided runs before analysis, so the
plan describes exactly the graphs that run and nothing is patched afterwards.

The compiled graphs run as plain FX code (no Inductor), op for op the kernels eager PyTorch would
call, which is what keeps losses and gradients equal to plain PyTorch. Compilers are "boxed" so
the backward graph receives its saved tensors in a list it may clear: a saved value is freed
after its last use in backward instead of living until the whole backward ends.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from memfit._compat import (
    aot_autograd,
    backward_keeps_graph,
    compiled_backward_ctx,
    compiled_function_ctx,
    disable_current_modes,
    own_donation,
    size_hint,
)
from memfit.analysis.backward_start import (
    BackwardStart,
    assumed_start,
    returns_loss,
    start_of,
)
from memfit.analysis.graph import JointGraph, node_tensors
from memfit.analysis.op_scratch import measure_op_scratch
from memfit.analysis.scheduled import scheduled_peak
from memfit.analysis.transfers import Link
from memfit.capture.attention import ATTENTION_MODES, AttentionSite, replace_attention
from memfit.capture.dropout import remove_identity_dropouts
from memfit.capture.passes import prepare_joint_graph
from memfit.capture.tangents import tangent_positions, without_tangents
from memfit.execution.accumulate import (
    LeafNotes,
    accumulate_into_grads,
    accumulating,
    output_values,
)
from memfit.execution.executors import (
    EAGER,
    INDUCTOR,
    CompiledPair,
    check_executor,
    compile_graph,
    compile_pair,
    decompositions,
)
from memfit.execution.offload import OffloadOptions, OffloadStore, copy_overlap, measure_link
from memfit.execution.partition import split_joint_graph
from memfit.execution.start_watch import StartWatch
from memfit.execution.symbolic import PlansBySize, capture_sizes
from memfit.measurement.calibrate import StepPeaks, measure_compiled_step
from memfit.measurement.cpu import cpu_recording_blocked
from memfit.measurement.timing import CompiledStep, inputs_device, step_time_ratios
from memfit.planning.budget import Budget, BudgetError
from memfit.planning.frontier import MIN_GAP
from memfit.planning.measured_search import Tried, search_plans
from memfit.planning.plan import GraphPlan, sized_key
from memfit.planning.planner import FrontierCache, plan_graph, with_executor_peaks
from memfit.planning.policy import BUDGET, Policy
from memfit.planning.step import GraphShare
from memfit.units import format_bytes
from memfit.warn import warn_user

__all__ = ["make_backend", "Offloader", "StepBudget"]


def _boxed(
    gm: fx.GraphModule,
    example_inputs: Any,
    on_run: Callable[[list[Any]], None] | None = None,
    executor: str = EAGER,
    kind: str = "inference",
    user_outputs: int | None = None,
    compiled: Callable[[list[Any]], Any] | None = None,
    donate: bool = False,
) -> Callable[..., Any]:
    """Run ``gm`` with the boxed convention *and* let it drop each input after its last use.

    ``make_boxed_func`` alone keeps the argument list alive for the whole call, so every saved
    tensor would live until the backward graph ends. Both executors (``execution.executors``)
    unpack and clear the list first; then a saved value dies right after its last reader, as
    the simulator assumes (measured: without this, ``"none"`` peaked 5-20% above eager).
    ``on_run`` is called with the arguments before every run (a planned forward graph reports
    that it ran, and at which sizes). ``compiled``: ``gm`` already compiled (while planning).
    ``donate``: a backward run once per forward may reuse its donated inputs' storage.
    """
    if compiled is None:
        compiled = compile_graph(gm, example_inputs, executor, kind, user_outputs, donate=donate)

    if on_run is None:

        def run(args: list[Any]) -> Any:
            return compiled(args)

    else:

        def run(args: list[Any]) -> Any:
            on_run(args)
            return compiled(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


_PLAN_META = "memfit_plan"
_USER_OUTPUTS_META = "memfit_user_outputs"
_SIZES_META = "memfit_plans_by_size"
_COMPILED_META = "memfit_compiled"
_EXAMPLES_META = "memfit_backward_examples"
_WATCH_META = "memfit_start_watch"


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


def _boxed_forward(
    gm: fx.GraphModule,
    example_inputs: Any,
    on_run: Callable[[list[Any]], None] | None = None,
    executor: str = EAGER,
) -> Callable[..., Any]:
    """``_boxed``, and the outputs the loss does not read get no gradient, as in eager.

    By default autograd hands an ``autograd.Function`` zeros for every output that got no
    gradient; turning that off lets the backward skip them (``capture.tangents``). Until its
    first backward, a planned graph's outputs are watched (``execution.start_watch``).
    """
    own_donation()  # memfit's backward decides what it writes into (_boxed_backward)
    user_outputs = gm.meta.get(_USER_OUTPUTS_META)
    run_graph = _boxed(
        gm, example_inputs, on_run, executor, "forward", user_outputs, gm.meta.get(_COMPILED_META)
    )
    shared = gm.meta.get(_WATCH_META)
    watch: StartWatch | None = shared.value if shared is not None else None
    if watch is not None and user_outputs is not None:
        watch.forward_graph(gm, user_outputs)

    leaves = LeafNotes()

    def run(args: list[Any]) -> Any:
        ctx = compiled_function_ctx()
        if ctx is None:
            return run_graph(args)
        ctx.set_materialize_grads(False)
        leaves.note(ctx, args)  # the backward adds into their .grad (execution.accumulate)
        if watch is None or not watch.pending:
            return run_graph(args)
        outputs = run_graph(args)
        watch.note_forward(ctx, outputs)
        return outputs

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


class _Shared:
    """A value in a graph's metadata that copies of the graph share: AOTAutograd deep-copies the
    backward graph before compiling it, and fake tensors cannot be copied outside their mode."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __deepcopy__(self, memo: dict[int, Any]) -> _Shared:
        return self


def _boxed_backward(
    gm: fx.GraphModule,
    example_inputs: Any,
    on_run: Callable[[list[Any]], None] | None = None,
    executor: str = EAGER,
) -> Callable[..., Any]:
    """``_boxed``, specialized to the tangents that arrive as None (``capture.tangents``) and
    to the parameters whose ``.grad`` it adds into (``execution.accumulate``)."""
    tangents = tangent_positions(gm)
    precompiled = gm.meta.get(_COMPILED_META)  # for every tangent, no .grad to add into
    # Compiled while planned, the forward reported its saved values' layouts to memfit, not to
    # AOTAutograd, whose examples then have eager's strides: compile for the reported ones.
    shared = gm.meta.get(_EXAMPLES_META)
    if shared is not None:
        example_inputs = shared.value
    bases: dict[frozenset[str], tuple[fx.GraphModule, list[torch.Tensor | None]]] = {}
    graphs: dict[tuple[frozenset[str], frozenset[int], bool], Callable[..., Any]] = {}
    shared_watch = gm.meta.get(_WATCH_META)
    watch: StartWatch | None = shared_watch.value if shared_watch is not None else None

    def run(args: list[Any]) -> Any:
        if on_run is not None:
            on_run(args)
        missing = frozenset(name for i, name in tangents if args[i] is None)
        if missing not in bases:
            base = without_tangents(gm, set(missing)) if missing else gm
            bases[missing] = (base, output_values(base))
        base, values = bases[missing]
        # The node the engine runs, or AOTAutograd's _backward_impl(ctx, ...) a few frames up.
        ctx = compiled_backward_ctx()
        if ctx is None:
            ctx = compiled_function_ctx(frames=5)
        if watch is not None and watch.pending:
            watch.note_backward(ctx, missing)
        positions, grads = accumulating(ctx, values)
        # A backward that keeps the graph (retain_graph=True) may run again on the same saved
        # values: it must not write into them (execution.executors.DONATED).
        once = not backward_keeps_graph()
        key = (missing, positions, once)
        if key not in graphs:
            specialized = accumulate_into_grads(base, positions) if positions else base
            examples = list(example_inputs) + [values[i] for i in sorted(positions)]
            graphs[key] = _boxed(
                specialized,
                examples,
                executor=executor,
                kind="backward",
                compiled=None if missing or positions or not once else precompiled,
                donate=once,
            )
        args.extend(grads)  # the trailing inputs of an accumulating graph
        return graphs[key](args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


#: How many plans of one graph Inductor compiles, at most, to find one within the budget.
SCHEDULE_TRIES = 4

#: Said when a graph captured for a range of sizes is planned for Inductor with a budget.
SYMBOLIC_BUDGET_WARNING = (
    "executor='inductor' with a budget, for a graph captured for a range of input sizes: "
    "memfit plans it against its op-by-op simulation, which Inductor's fused kernels can peak "
    "above (measured up to 1.3x on a transformer encoder), so the budget is not guaranteed; "
    "use executor='eager' (the default) for a budget that must hold"
)

#: Said when a budget planned for Inductor is checked against Inductor's schedule only.
UNMEASURED_BUDGET_WARNING = (
    "executor='inductor' with a budget: the compiled graphs could not be measured while they "
    "were planned (a CPU profiler session was running, such as memfit.measure around the first "
    "call), so the budget is checked against Inductor's own buffer-lifetime estimate, which can "
    "be off (measured 1.38x low on a transformer encoder): the budget is not guaranteed for this "
    "call; memfit plans again, measuring the compiled graphs, on its first call outside a "
    "profiler session"
)


def _fit_schedule(
    jg: JointGraph,
    graph_plan: GraphPlan,
    plan: Callable[[int], GraphPlan],
    split: Callable[[GraphPlan], tuple[fx.GraphModule, fx.GraphModule]],
    user_outputs: int,
    limit_bytes: int | None,
    primals: Sequence[Any] | None,
    strict: bool = True,
    at_least_peak: bool = False,
    at_least_first: bool = False,
    tries: int = SCHEDULE_TRIES,
    keep_within: int | None = None,
    rival: Callable[[], GraphPlan] | None = None,
) -> tuple[GraphPlan, fx.GraphModule, fx.GraphModule, bool, int | None]:
    """``graph_plan`` compiled by Inductor now, its peaks measured (or, where they cannot be,
    read from Inductor's schedule), and planned again with headroom while they exceed
    ``limit_bytes``.

    The simulator replays memfit's op order; Inductor fuses, lays out and orders kernels itself,
    so a plan within the budget in simulation can peak above it as compiled. The compiled
    forward and backward run once on ``primals`` (the real parameters and inputs of the call
    being captured, in the joint graph's order: ``measurement.calibrate``); without them, or
    while a CPU profiler runs, the peaks come from the buffer lifetimes of Inductor's schedule
    (``analysis.scheduled``), which can be off (measured 1.38x low on a transformer encoder).
    Plans are tried by ``planning.measured_search``: the excess of a compiled plan over its
    simulation taken off the budget of the next plan (``plan(headroom)``), a shortfall given back
    (the simulation replays eager's kernels and their scratch, which Inductor's fused,
    channels-last kernels often do not need: a U-Net's least-peak plan measured 0.85x its
    simulation), bisecting between a headroom that fitted and one that did not: at most
    ``tries`` compiles in all. With ``at_least_peak`` (``"memory"``), the limit is the
    first plan's measured peak: a cheaper plan that peaks no higher once compiled is taken
    instead; with ``at_least_first`` (a fraction whose bytes are the first plan's simulated
    peak), the limit is raised to the first plan's measured peak where that is higher. The
    cheapest plan that fits is kept; if none does, ``BudgetError`` naming the least
    peak (or, not ``strict``: a graph of a step with graph breaks, whose budget is settled for
    the whole step, that plan, and its note says so). The compiled graphs travel in the graphs'
    metadata, so AOTAutograd's compilers reuse them. With ``keep_within`` (a budget the plans
    are searched above, as ``"memory"``'s), the cheapest plan within it is kept, or else the one
    with the least peak, and nothing is raised. With a ``rival`` (a budget's, ``"speed"``'s
    plan), the cheapest plan within the limit is timed against it where both fit once compiled,
    and the faster kept (``_faster``). Last in the result: whether the kept plan's peaks were
    measured (not read from the schedule), and the limit the plans were held to.
    """
    by_name = {n.name: n for n in jg.nodes}

    def peaks(fw: fx.GraphModule, pair: CompiledPair) -> tuple[int, int]:
        """The scheduled forward's and backward's peaks. A saved value is the buffer Inductor's
        forward returns it in (views of one buffer are one allocation); the user's outputs are
        held while the backward runs; other inputs count as memfit's storages, parameters and
        user inputs not at all."""
        output = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
        outs = list(output.args[0])
        buffer_of = {
            out.name: buffer
            for out, buffer in zip(outs, pair.forward_schedule.outputs)
            if isinstance(out, fx.Node)
        }
        allocated = pair.forward_schedule.output_bytes(list(buffer_of.values()))
        held = {
            buffer_of[out.name]
            for out in outs[:user_outputs]
            if isinstance(out, fx.Node) and buffer_of.get(out.name) in allocated
        }

        def storages(name: str) -> list[tuple[Any, int]]:
            buffer = buffer_of.get(name)
            if buffer is not None:
                if buffer not in allocated or buffer in held:
                    return []
                return [(buffer, allocated[buffer])]
            node = by_name[name]  # KeyError: a name memfit does not know, at Inductor's size
            return [(k, jg.storage_bytes[k]) for k in jg.storages[node] if k not in jg.primal_keys]

        return (
            scheduled_peak(pair.forward_schedule.buffers, storages),
            scheduled_peak(
                pair.backward_schedule.buffers, storages, sum(allocated[b] for b in held)
            ),
        )

    def predicted(
        graph_plan: GraphPlan, fw: fx.GraphModule, bw: fx.GraphModule, pair: CompiledPair
    ) -> tuple[GraphPlan, bool]:
        measured = _calibrate(fw, bw, user_outputs, primals)
        if measured is None and limit_bytes is not None:
            warn_user(UNMEASURED_BUDGET_WARNING)
        if measured is not None:
            plan = with_executor_peaks(
                graph_plan,
                measured.forward_peak_bytes,
                measured.backward_peak_bytes,
                forward_end=measured.forward_end_bytes,
                source="the compiled graphs, measured once",
            )
            return plan, True
        scheduled = peaks(fw, pair)
        return with_executor_peaks(graph_plan, *scheduled, source="Inductor's schedule"), False

    def measured(graph_plan: GraphPlan) -> Tried[tuple[fx.GraphModule, fx.GraphModule, bool]]:
        fw, bw = split(graph_plan)
        pair = compile_pair(fw, bw, user_outputs)
        fw.meta[_COMPILED_META] = pair.forward
        bw.meta[_COMPILED_META] = pair.backward
        bw.meta[_EXAMPLES_META] = _Shared(pair.backward_examples)
        plan, was_measured = predicted(graph_plan, fw, bw, pair)
        return Tried(plan, (fw, bw, was_measured))

    done, limit_bytes = search_plans(
        graph_plan,
        measured,
        plan,
        limit_bytes,
        tries=tries,
        at_least_peak=at_least_peak,
        at_least_first=at_least_first,
        resolution_bytes=_largest_value(jg) // 4,
    )
    made = [(t.plan, *t.made) for t in done]
    within = limit_bytes if keep_within is None else keep_within
    least = made[_kept_within([t[0] for t in made], within)]
    if within is None or least[0].predicted_peak_bytes <= within or keep_within is not None:
        if rival is not None and within is not None and keep_within is None and least[3]:
            least = _faster(least, rival(), measured, within, primals)
        return (*least, limit_bytes)
    assert limit_bytes is not None  # nothing fits: ``least`` is the least peak
    note = (
        f"compiled by Inductor, the least peak of the {len(made)} plans tried is "
        f"{format_bytes(least[0].predicted_peak_bytes)}, above the budget of "
        f"{format_bytes(limit_bytes)}"
    )
    if strict:
        raise BudgetError(
            f"no plan fits: {note} (measured once compiled); use a larger budget, or "
            f"executor='eager', whose peaks are the simulation's",
            budget_bytes=limit_bytes,
            smallest_bytes=least[0].predicted_peak_bytes,
        )
    return (
        dataclasses.replace(least[0], note=f"{least[0].note}; {note}"),
        *least[1:],
        limit_bytes,
    )


#: Rounds ``_faster`` times its two compiled plans for: each round runs each once. Measured on
#: a 2-core CPU (the frontier's ResNet, 120 rounds of one pair): medians of 15 consecutive
#: rounds spread 0.955-1.001 about the whole run's 0.973, of 30 rounds 0.961-0.988.
TIMED_ROUNDS = 30

#: A rival within this share of the cheapest plan's time is a tie, which the rival, keeping
#: less, wins: the same speed for less memory. About the spread of 30 rounds' medians (above).
TIMED_TIE = 0.01

#: What each side of a timed choice is: the plan, its compiled graphs, whether it was measured.
_Made = tuple[GraphPlan, fx.GraphModule, fx.GraphModule, bool]


def _faster(
    cheapest: _Made,
    rival: GraphPlan,
    measured: Callable[[GraphPlan], Tried[tuple[fx.GraphModule, fx.GraphModule, bool]]],
    limit_bytes: int,
    primals: Sequence[Any] | None,
) -> _Made:
    """Of the cheapest plan within ``limit_bytes`` and ``rival`` (``"speed"``'s plan), the one
    whose compiled step runs faster (the rival on a tie), where both fit once compiled.

    Why: the cost model is an estimate (recomputation at its FLOPs where Inductor fuses it, the
    traffic of what is kept: ``analysis.cost``), and which plan Inductor runs faster
    depends on how the backward's kernels fuse around the recomputed values, which it does not
    see. Before kept values were priced, on a CPU ResNet with BatchNorm ``budget=1``'s plan,
    keeping almost everything (59.8 MiB), ran 1.04x the step of ``"speed"``'s (35.3 MiB); on a
    U-Net, plans keeping less ran 4-12% slower (``benchmarks/results/keep_traffic``, six ways
    of pricing kept bytes tried). So both are compiled, measured, and timed on the step's own
    inputs (``measurement.timing``: ``TIMED_ROUNDS`` interleaved rounds, the median of per-round
    ratios), and the rival kept unless it ran slower by more than ``TIMED_TIE``: at the same
    speed, the plan keeping less (on the ResNet, ``budget=0.8``'s 47.3 MiB plan and the rival
    timed 0.999x over 120 rounds; in whole steps the rival was 1-2% faster). A rival
    simulated above the limit, or keeping no less than the cheapest plan (by ``MIN_GAP`` of plain
    autograd's peak: the frontier's transformer, whose ``"speed"`` plan is its plan keeping
    everything), is not compiled.
    """
    plan = cheapest[0]
    keeps_less = rival.kept_bytes < plan.kept_bytes - MIN_GAP * plan.baseline_peak_bytes
    if not keeps_less or rival.predicted_peak_bytes > limit_bytes:
        return cheapest
    tried = measured(rival)
    fw, bw, was_measured = tried.made
    if not was_measured or tried.plan.predicted_peak_bytes > limit_bytes:
        return cheapest
    steps = [
        _compiled_step(g_fw, g_bw, primals) for g_fw, g_bw in ((cheapest[1], cheapest[2]), (fw, bw))
    ]
    if steps[0] is None or steps[1] is None:
        return cheapest
    try:
        with disable_current_modes():
            ratio = step_time_ratios([steps[0], steps[1]], TIMED_ROUNDS)[1]
    except _CannotCalibrate:
        return cheapest
    timed = (
        f"timed once compiled, {TIMED_ROUNDS} rounds: the cheapest plan within the "
        f'budget ({format_bytes(plan.predicted_peak_bytes)}) against "speed"\'s '
        f"({format_bytes(tried.plan.predicted_peak_bytes)}), which ran {ratio:.3f}x its step"
    )
    if ratio <= 1.0 + TIMED_TIE:
        return (dataclasses.replace(tried.plan, note=f"{tried.plan.note}; {timed}"), fw, bw, True)
    return (dataclasses.replace(plan, note=f"{plan.note}; {timed}"), *cheapest[1:])


def _kept_within(plans: Sequence[GraphPlan], budget_bytes: int | None) -> int:
    """Which of the compiled ``plans`` to keep: the cheapest within the budget (None: no
    limit), or else the least peak, which a refusal names. For a refused budget searched as
    ``"memory"``'s the budget is the user's, not the search's own limit (its first plan's
    peak): the cheapest plan under that limit can peak above the budget while another plan it
    compiled is within it."""
    within = [
        i
        for i, p in enumerate(plans)
        if budget_bytes is None or p.predicted_peak_bytes <= budget_bytes
    ]
    if within:
        return min(within, key=lambda i: (plans[i].cost_seconds, plans[i].predicted_peak_bytes))
    return min(range(len(plans)), key=lambda i: plans[i].predicted_peak_bytes)


def _reached_fraction(policy: Policy, graph_plan: GraphPlan) -> bool:
    """Whether ``graph_plan``'s budget is a fraction that plain autograd's peak, less the
    activations it gives up, puts below every plan keeping that share of the activations, so that
    its bytes are the least simulated peak of such a plan (``planning.planner``'s
    ``_fraction_reach``): a fraction is met whenever some plan keeps that share. Compiled, that
    plan can peak a few percent above its simulation (the frontier's ResNet at a batch of 1,
    ``budget=0.6``: 2.49 MiB against 2.36), and holding it to the simulation refused the budget.
    """
    budget = policy.budget
    if policy.name != BUDGET or budget is None or budget.fraction is None:
        return False
    if graph_plan.budget_bytes is None:
        return False
    resolved = budget.resolve(graph_plan.baseline_peak_bytes, graph_plan.baseline_kept_bytes)
    return graph_plan.budget_bytes > resolved


def _calibrate(
    fw: fx.GraphModule, bw: fx.GraphModule, user_outputs: int, primals: Sequence[Any] | None
) -> StepPeaks | None:
    """The compiled pair's peaks measured on ``primals``, or None where that cannot be done."""
    step = _compiled_step(fw, bw, primals)
    if step is None:
        return None
    try:
        with disable_current_modes():  # the partitioner runs under fake tensors: run real ones
            return measure_compiled_step(
                step.forward, step.backward, step.inputs, step.backward_inputs, user_outputs
            )
    except _CannotCalibrate:
        return None


def _compiled_step(
    fw: fx.GraphModule, bw: fx.GraphModule, primals: Sequence[Any] | None
) -> CompiledStep | None:
    """The pair compiled from ``fw`` and ``bw`` (in their metadata) as a step on ``primals``
    (the real parameters and inputs of the call being captured), or None where their sizes are
    not the graph's. The backward gets what the forward saved and gradients of ones; making them
    raises ``_CannotCalibrate`` where a backward input is neither."""
    if primals is None:
        return None
    fw_placeholders = [n for n in fw.graph.nodes if n.op == "placeholder"]
    # Inputs the forward writes into (BatchNorm's running statistics, updated inside the
    # compiled graph as torch.compile does): the step gets copies, so the user's buffers are
    # updated once per step, by the step.
    mutated = {
        n.args[0]
        for n in fw.graph.nodes
        if n.op == "call_function" and n.target is torch.ops.aten.copy_.default
    }
    inputs: list[Any] = []
    for p in fw_placeholders:
        index = _primal_index(p.name)
        if index is None or index >= len(primals):
            return None
        value, fake = primals[index], p.meta.get("val")
        if isinstance(value, torch.SymInt):  # a size captured as a symbol: its value now
            value = size_hint(value)
        if isinstance(fake, torch.Tensor) and (
            not isinstance(value, torch.Tensor)
            or tuple(value.shape) != tuple(size_hint(d) for d in fake.shape)
        ):
            return None
        if p in mutated:
            with disable_current_modes():
                value = value.clone()
        inputs.append(value)
    output = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
    names = [o.name if isinstance(o, fx.Node) else None for o in output.args[0]]
    position = {name: i for i, name in enumerate(names) if name is not None}
    bw_placeholders = [n for n in bw.graph.nodes if n.op == "placeholder"]
    device = inputs_device(inputs)

    def backward_inputs(outputs: Sequence[Any]) -> list[Any]:
        args: list[Any] = []
        for p in bw_placeholders:
            if p.name in position:
                args.append(outputs[position[p.name]])
                continue
            fake = p.meta.get("val")
            if not isinstance(fake, torch.Tensor) or device is None:
                raise _CannotCalibrate(p.name)
            shape = [size_hint(d) for d in fake.shape]  # the call's sizes where symbolic
            args.append(torch.ones(shape, dtype=fake.dtype, device=device))
        return args

    return CompiledStep(fw.meta[_COMPILED_META], bw.meta[_COMPILED_META], inputs, backward_inputs)


class _CannotCalibrate(Exception):
    """A backward input is neither saved by the forward nor a tensor memfit can make."""


def _primal_index(name: str) -> int | None:
    prefix = "primals_"
    if not name.startswith(prefix) or not name[len(prefix) :].isdigit():
        return None
    return int(name[len(prefix) :]) - 1


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


def _largest_value(jg: JointGraph) -> int:
    return max(jg.storage_bytes.values(), default=0)


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
        jg.op_scratch = measure_op_scratch(jg.nodes, min_bytes=_largest_value(jg) // 64)
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
        if executor == INDUCTOR and jg.symbols and policy.name == BUDGET and not measured_fit:
            warn_user(SYMBOLIC_BUDGET_WARNING)
        fw: fx.GraphModule | None = None
        bw: fx.GraphModule | None = None
        measured = False  # whether the plan's peaks were measured once compiled
        if measured_fit:
            byte_budget = policy.budget is not None and policy.budget.fraction is None
            fraction = (
                policy.budget.fraction
                if policy.name == BUDGET and policy.budget is not None
                else None
            )
            limit_bytes: int | None = None
            # A fraction whose bytes are a plan's simulated peak (see _reached_fraction): held
            # to what that plan peaks at once compiled where that is higher.
            reached = (
                not refused
                and graph_share is None
                and not spent
                and _reached_fraction(policy, graph_plan)
            )
            if not refused and policy.name == BUDGET and graph_plan.budget_bytes is not None:
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
            at_least_peak = (policy.name == "memory" or bool(refused)) and at_least_peak_ok
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
                return _fit_schedule(
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
                        smallest_bytes=least_peak,
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
        fw.meta[_PLAN_META] = bw.meta[_PLAN_META] = graph_plan
        if on_backward_start is not None:
            fw.meta[_WATCH_META] = bw.meta[_WATCH_META] = _Shared(
                _start_watch(jg, graph_plan, key, on_backward_start)
            )
        fw.meta[_USER_OUTPUTS_META] = kwargs["num_fwd_outputs"]
        if by_size is not None:
            fw.meta[_SIZES_META] = by_size
        return fw, bw

    def compile_forward(gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        planned: GraphPlan | None = gm.meta.get(_PLAN_META)
        if planned is None:  # not partitioned by memfit: no plan to report
            return _boxed_forward(gm, example_inputs, executor=executor)
        plan: GraphPlan = planned
        by_size: PlansBySize | None = gm.meta.get(_SIZES_META)
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

        return _boxed_forward(gm, example_inputs, on_run=ran, executor=executor)

    def compile_backward(gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        planned: GraphPlan | None = gm.meta.get(_PLAN_META)
        if planned is None or on_backward is None:
            return _boxed_backward(gm, example_inputs, executor=executor)
        plan: GraphPlan = planned
        report = on_backward
        return _boxed_backward(
            gm, example_inputs, on_run=lambda args: report(plan), executor=executor
        )

    def compile_inference(gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        return _boxed(gm, example_inputs, executor=executor)

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
