"""A plan compiled by Inductor, fitted to its budget: compiled, its peaks measured (or read
from Inductor's schedule), planned again with headroom while they exceed the budget, and, with
autotune, timed against its rival (``execution.partitioner`` calls ``fit_schedule`` from its
partition under ``executor="inductor"``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from memfit._compat import (
    disable_current_modes,
    size_hint,
)
from memfit.analysis.graph import JointGraph
from memfit.analysis.scheduled import scheduled_peak
from memfit.execution.executors import (
    CompiledPair,
    compile_pair,
)
from memfit.execution.runners import COMPILED_META, EXAMPLES_META, Shared
from memfit.measurement.calibrate import StepPeaks, measure_compiled_step
from memfit.measurement.timing import CompiledStep, inputs_device, step_time_ratios
from memfit.planning.budget import BudgetError
from memfit.planning.frontier import MIN_GAP
from memfit.planning.measured_search import Tried, search_plans
from memfit.planning.plan import GraphPlan
from memfit.planning.planner import with_executor_peaks
from memfit.planning.policy import Policy
from memfit.units import format_bytes
from memfit.warn import warn_user

__all__ = [
    "SCHEDULE_TRIES",
    "SYMBOLIC_BUDGET_WARNING",
    "TIMED_ROUNDS",
    "TIMED_TIE",
    "UNMEASURED_BUDGET_WARNING",
    "calibrate",
    "fit_schedule",
    "kept_within",
    "largest_value",
    "reached_fraction",
]


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


def fit_schedule(
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

    def measured(graph_plan: GraphPlan) -> Tried[tuple[fx.GraphModule, fx.GraphModule, bool]]:
        fw, bw = split(graph_plan)
        pair = compile_pair(fw, bw, user_outputs)
        fw.meta[COMPILED_META] = pair.forward
        bw.meta[COMPILED_META] = pair.backward
        bw.meta[EXAMPLES_META] = Shared(pair.backward_examples)
        plan, was_measured = _predicted(
            jg, graph_plan, fw, bw, pair, user_outputs, primals, limit_bytes
        )
        return Tried(plan, (fw, bw, was_measured))

    done, limit_bytes = search_plans(
        graph_plan,
        measured,
        plan,
        limit_bytes,
        tries=tries,
        at_least_peak=at_least_peak,
        at_least_first=at_least_first,
        resolution_bytes=largest_value(jg) // 4,
    )
    made = [(t.plan, *t.made) for t in done]
    within = limit_bytes if keep_within is None else keep_within
    least = made[kept_within([t[0] for t in made], within)]
    if within is None or least[0].predicted_peak_bytes <= within or keep_within is not None:
        if rival is not None and within is not None and keep_within is None and least[3]:
            least = _faster(least, rival(), measured, within, primals)
        return (*least, limit_bytes)
    assert limit_bytes is not None  # nothing fits: ``least`` is the least peak
    return (*_over_budget(least, len(made), limit_bytes, strict), limit_bytes)


def _over_budget(
    least: tuple[GraphPlan, fx.GraphModule, fx.GraphModule, bool],
    tried: int,
    limit_bytes: int,
    strict: bool,
) -> tuple[GraphPlan, fx.GraphModule, fx.GraphModule, bool]:
    """Where none of the ``tried`` compiled plans fits ``limit_bytes``: ``BudgetError`` naming
    the least peak, or (not ``strict``) ``least``, its note saying so."""
    note = (
        f"compiled by Inductor, the least peak of the {tried} plans tried is "
        f"{format_bytes(least[0].predicted_peak_bytes)}, above the budget of "
        f"{format_bytes(limit_bytes)}"
    )
    if strict:
        raise BudgetError(
            f"no plan fits: {note} (measured once compiled); use a larger budget, or "
            f"executor='eager', whose peaks are the simulation's",
            budget_bytes=limit_bytes,
            least_bytes=least[0].predicted_peak_bytes,
        )
    return (dataclasses.replace(least[0], note=f"{least[0].note}; {note}"), *least[1:])


def _predicted(
    jg: JointGraph,
    graph_plan: GraphPlan,
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    pair: CompiledPair,
    user_outputs: int,
    primals: Sequence[Any] | None,
    limit_bytes: int | None,
) -> tuple[GraphPlan, bool]:
    """``graph_plan`` predicted from its compiled graphs: their peaks measured once on
    ``primals``, or where they cannot be, read from Inductor's schedule (warning once when a
    budget then rests on the schedule); and whether they were measured."""
    measured = calibrate(fw, bw, user_outputs, primals)
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
    scheduled = _scheduled_peaks(jg, fw, pair, user_outputs)
    return with_executor_peaks(graph_plan, *scheduled, source="Inductor's schedule"), False


def _scheduled_peaks(
    jg: JointGraph, fw: fx.GraphModule, pair: CompiledPair, user_outputs: int
) -> tuple[int, int]:
    """The scheduled forward's and backward's peaks. A saved value is the buffer Inductor's
    forward returns it in (views of one buffer are one allocation); the user's outputs are
    held while the backward runs; other inputs count as memfit's storages, parameters and
    user inputs not at all."""
    by_name = {n.name: n for n in jg.nodes}
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
        scheduled_peak(pair.backward_schedule.buffers, storages, sum(allocated[b] for b in held)),
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
    U-Net, plans keeping less ran 4-12% slower (``docs/measurements.md``, six ways
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


def kept_within(plans: Sequence[GraphPlan], budget_bytes: int | None) -> int:
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


def reached_fraction(policy: Policy, graph_plan: GraphPlan) -> bool:
    """Whether ``graph_plan``'s budget is a fraction that plain autograd's peak, less the
    activations it gives up, puts below every plan keeping that share of the activations, so that
    its bytes are the least simulated peak of such a plan (``planning.planner``'s
    ``_fraction_reach``): a fraction is met whenever some plan keeps that share. Compiled, that
    plan can peak a few percent above its simulation (the frontier's ResNet at a batch of 1,
    ``budget=0.6``: 2.49 MiB against 2.36), and holding it to the simulation refused the budget.
    """
    budget = policy.budget
    if policy.budget is None or budget is None or budget.fraction is None:
        return False
    if graph_plan.budget_bytes is None:
        return False
    resolved = budget.resolve(graph_plan.baseline_peak_bytes, graph_plan.baseline_kept_bytes)
    return graph_plan.budget_bytes > resolved


def calibrate(
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

    return CompiledStep(fw.meta[COMPILED_META], bw.meta[COMPILED_META], inputs, backward_inputs)


class _CannotCalibrate(Exception):
    """A backward input is neither saved by the forward nor a tensor memfit can make."""


def _primal_index(name: str) -> int | None:
    prefix = "primals_"
    if not name.startswith(prefix) or not name[len(prefix) :].isdigit():
        return None
    return int(name[len(prefix) :]) - 1


def largest_value(jg: JointGraph) -> int:
    """Bytes of ``jg``'s largest storage: the scale of what is worth measuring or resolving."""
    return max(jg.storage_bytes.values(), default=0)
