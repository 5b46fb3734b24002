"""``memfit.pipeline.plan``: where to cut a model into K stages, and what each stage will cost.

The cut is chosen exactly (``intervals.balance_intervals``) over the candidate cuts of the
captured forward (``partition.item_boundaries``) for the predicted step time of the schedule,
``(M - 1) * slowest stage + sum of stages``, with every stage's predicted peak within the
per-device budget. The stage model used for the search is GPipe's: a stage keeps, per micro-batch
in flight, only what crosses its cuts and recomputes the rest in backward, so while one
micro-batch's backward runs it holds that micro-batch's activations (``costs``). Then each stage
gets memfit's own plan: the stage's graph is planned by memfit's planner (its Pareto frontier of
peak against recomputation), and the point with the least recomputation whose predicted peak,
with the other micro-batches in flight, fits the budget is kept (re-planned at that budget, which
may keep less: its numbers are the prediction). A span the planner cannot fit within the budget
is refused and the search runs again without it (``refuse``). Without a budget every stage keeps
everything (the fastest plan).

What a stage holds, in the terms of the table this module prints (per device):

* state: its parameters and buffers, their gradients, and the optimizer state if given
  (``optimizer_state`` bytes per parameter byte: 2 for Adam, 1 for SGD with momentum);
* buffers: ``torch.distributed.pipelining`` allocates a receive buffer for every micro-batch's
  input and every micro-batch's output gradient when the schedule first runs, and keeps them,
  so ``M x (received + sent)`` bytes whatever the schedule;
* in flight: micro-batches whose forward has run and whose backward has not, each holding what
  the stage's plan keeps plus its outputs: ``M`` of them under GPipe, at most ``K - s`` under
  1F1B (stage ``s``);
* the transient of one micro-batch's forward and backward, as memfit's simulator predicts it,
  and from the second backward on the gradients accumulated so far beside the new ones
  (``step_peak``).

Time per micro-batch is profiled forward time times three (forward, backward at twice the
forward) plus the recomputation the plan does, plus, when ``bandwidth`` is given, the transfer of
what crosses the stage's outgoing cut forward and its gradient back.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from memfit.execution.state import preserved
from memfit.pipeline.balancing import pipeline_step_time
from memfit.pipeline.costs import ItemCosts, measure_items
from memfit.pipeline.intervals import CapacityError, balance_intervals
from memfit.pipeline.partition import (
    CapturedForward,
    StageGraph,
    capture_forward,
    crossing_bytes,
    item_boundaries,
    split_stages,
    tensor_bytes,
)
from memfit.planning.budget import BudgetError, parse_budget
from memfit.planning.plan import ParetoPoint
from memfit.units import format_bytes

__all__ = [
    "SCHEDULES",
    "PipelinePlan",
    "Search",
    "StagePlan",
    "budget_per_device",
    "check_arguments",
    "prepare_search",
    "choose_cuts",
    "in_flight",
    "microbatch",
    "plan",
    "plan_stage",
    "refuse",
    "stage_inputs",
    "step_peak",
]

SCHEDULES = ("gpipe", "1f1b")

#: forward + backward as a multiple of the forward alone (backward ~ 2x forward)
TRAINING_FACTOR = 3.0


def in_flight(schedule: str, stage: int, stages: int, microbatches: int) -> int:
    """Micro-batches stage ``stage`` holds at once: all under GPipe, ``K - s`` under 1F1B."""
    if schedule == "gpipe":
        return microbatches
    return min(microbatches, stages - stage)


def step_peak(
    schedule: str, microbatches: int, flight: int, each: int, transient: int, grads: int
) -> int:
    """A stage's peak during a step; see :attr:`StagePlan.step_peak_bytes`."""
    if microbatches == 1:
        return transient
    if schedule == "1f1b" and microbatches > flight:
        return (flight - 1) * each + transient + grads
    return (flight - 2) * each + transient + max(each, grads)


@dataclass(frozen=True)
class StagePlan:
    """One stage's cut, plan and prediction. Bytes are per device; times per micro-batch."""

    index: int
    start: int
    end: int
    modules: tuple[str, ...]
    parameter_bytes: int
    buffer_bytes: int
    optimizer_bytes: int
    receive_bytes: int
    send_bytes: int
    in_flight: int
    microbatches: int
    kept_bytes: int
    transient_bytes: int
    forward_seconds: float
    recompute_seconds: float
    transfer_seconds: float
    #: the activation budget memfit plans this stage's graph with (one micro-batch)
    budget_bytes: int
    #: the last stage sends nothing: its "sent" bytes are the model's outputs, held per
    #: micro-batch until the loss's backward, with no gradient buffer
    is_last: bool = False
    schedule: str = "gpipe"

    @property
    def first_module(self) -> str:
        return self.modules[0] if self.modules else ""

    @property
    def last_module(self) -> str:
        return self.modules[-1] if self.modules else ""

    @property
    def time_seconds(self) -> float:
        """Forward, backward, recomputation and transfer of one micro-batch."""
        return (
            TRAINING_FACTOR * self.forward_seconds + self.recompute_seconds + self.transfer_seconds
        )

    @property
    def state_bytes(self) -> int:
        """Parameters, buffers, gradients and optimizer state: held between steps."""
        return 2 * self.parameter_bytes + self.buffer_bytes + self.optimizer_bytes

    @property
    def buffers_bytes(self) -> int:
        """The schedule's receive buffers: every micro-batch's input and output gradient."""
        return self.microbatches * (self.receive_bytes + (0 if self.is_last else self.send_bytes))

    @property
    def step_peak_bytes(self) -> int:
        """Peak above what is live before a step (gradients not yet allocated).

        ``transient_bytes`` is memfit's prediction for one micro-batch's forward and backward,
        its parameter gradients included. Around it: the other micro-batches in flight, each
        holding what the plan keeps and its outputs; and, from the second backward on, the
        gradients accumulated so far, alive beside the new ones the backward makes. Under
        GPipe the first backward has ``M - 1`` others in flight and no gradients yet, the
        second ``M - 2`` and the gradients; under 1F1B with more micro-batches than stages, a
        new forward refills the stage after each backward, so later backwards run beside
        ``in_flight - 1`` others and the gradients.
        """
        return step_peak(
            self.schedule,
            self.microbatches,
            self.in_flight,
            self.kept_bytes + self.send_bytes,
            self.transient_bytes,
            self.parameter_bytes,
        )

    @property
    def peak_bytes(self) -> int:
        """Everything the stage's device holds at the peak of a step."""
        return (
            self.parameter_bytes
            + self.buffer_bytes
            + self.optimizer_bytes
            + self.buffers_bytes
            + self.step_peak_bytes
        )


@dataclass(frozen=True)
class PipelinePlan:
    """Stage boundaries, per-stage predictions and the predicted step of the schedule."""

    stages: tuple[StagePlan, ...]
    schedule: str
    microbatches: int
    cuts: tuple[int, ...]
    budget_bytes: int | None
    candidate_cuts: int

    @property
    def step_seconds(self) -> float:
        """Predicted step: ``(M - 1) * slowest stage + sum of stages``."""
        times = [s.time_seconds for s in self.stages]
        return pipeline_step_time(times, [1] * len(times), microbatches=self.microbatches)

    @property
    def bubble(self) -> float:
        """Idle share of the devices' time: ``1 - M * mean stage time / step``; for equal stages
        ``(K - 1) / (M + K - 1)``."""
        step = self.step_seconds
        if step <= 0:
            return 0.0
        mean = sum(s.time_seconds for s in self.stages) / len(self.stages)
        return max(0.0, 1.0 - self.microbatches * mean / step)

    @property
    def peak_bytes(self) -> int:
        return max(s.peak_bytes for s in self.stages)

    def __str__(self) -> str:
        k = len(self.stages)
        budget = format_bytes(self.budget_bytes) if self.budget_bytes else "none"
        lines = [
            f"memfit pipeline: {k} stages, {self.microbatches} micro-batches, "
            f"{self.schedule}, budget {budget} per device "
            f"({self.candidate_cuts} candidate cuts)",
            f"{'stage':>5} {'time/mb':>9} {'state':>10} {'buffers':>10} "
            f"{'in flight':>9} {'kept/mb':>10} {'peak':>10}  modules",
        ]
        for s in self.stages:
            span = (
                s.first_module
                if s.first_module == s.last_module
                else (f"{s.first_module} .. {s.last_module}")
            )
            lines.append(
                f"{s.index:>5} {s.time_seconds * 1e3:>7.2f}ms "
                f"{format_bytes(s.state_bytes):>10} {format_bytes(s.buffers_bytes):>10} "
                f"{s.in_flight:>9} {format_bytes(s.kept_bytes):>10} "
                f"{format_bytes(s.peak_bytes):>10}  {span}"
            )
        lines.append(
            f"predicted step {self.step_seconds * 1e3:.2f} ms, bubble {self.bubble:.1%} "
            f"((K-1)/(M+K-1) = {(k - 1) / (self.microbatches + k - 1):.1%}), "
            f"largest stage peak {format_bytes(self.peak_bytes)}"
        )
        return "\n".join(lines)


def microbatch(example_inputs: tuple[Any, ...], microbatches: int) -> tuple[Any, ...]:
    """The first of ``microbatches`` equal chunks (along dim 0) of every tensor input.

    The schedule splits a mini-batch with ``tensor_split`` along dim 0; memfit plans for equal
    micro-batches, so every tensor's first dimension must be the same multiple of ``M``.
    """
    sizes = {t.shape[0] for t in example_inputs if isinstance(t, torch.Tensor) and t.dim() > 0}
    if not sizes:
        raise ValueError("the pipeline needs at least one tensor input with a batch dimension")
    if len(sizes) > 1:
        raise ValueError(f"tensor inputs have different batch sizes {sorted(sizes)} (dim 0)")
    batch = sizes.pop()
    if batch % microbatches:
        raise ValueError(
            f"a batch of {batch} does not split into {microbatches} equal micro-batches; "
            f"use a batch size that is a multiple of {microbatches}"
        )
    return tuple(
        t.tensor_split(microbatches)[0] if isinstance(t, torch.Tensor) and t.dim() > 0 else t
        for t in example_inputs
    )


def check_arguments(stages: int, microbatches: int, schedule: str, optimizer_state: float) -> None:
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be a positive integer, got {stages!r}")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be a positive integer, got {microbatches!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if schedule == "1f1b" and microbatches < stages:
        raise ValueError(
            f"1F1B needs at least as many micro-batches as stages ({microbatches} < {stages}); "
            "use more micro-batches or schedule='gpipe'"
        )
    if not math.isfinite(optimizer_state) or optimizer_state < 0:
        raise ValueError("optimizer_state must be >= 0 bytes per parameter byte")


def budget_per_device(budget: int | str | None) -> int | None:
    if budget is None:
        return None
    parsed = parse_budget(budget)
    if parsed.bytes is None:
        raise ValueError(
            "a pipeline budget is bytes per device (an int or a size such as '2GiB'), "
            "not a fraction"
        )
    return parsed.bytes


@dataclass
class Search:
    """The captured forward and its profiled items: what the cut search reads.

    Made once per model (``prepare_search``: capture, candidate cuts, profiling); the search,
    the split and every stage's plan read it.
    """

    captured: CapturedForward
    costs: ItemCosts
    crossing: list[int]
    output_bytes: int


def prepare_search(
    model: nn.Module, micro: tuple[Any, ...], max_items: int, repeats: int = 3
) -> Search:
    """Capture ``model`` on one micro-batch, choose candidate cuts, profile the items.

    ``repeats``: profiled runs (the median is kept); 1 when the times will come from elsewhere
    (ranks other than 0 take rank 0's).
    """
    captured = capture_forward(model, micro)
    boundaries = item_boundaries(captured, max_items)
    costs = measure_items(captured, captured.placeholder_values, boundaries, repeats=repeats)
    output_node = next(iter(captured.graph.graph.find_nodes(op="output")))
    outputs = [a for a in output_node.all_input_nodes]
    output_bytes = sum(tensor_bytes(a.meta.get("example_value")) for a in outputs)
    return Search(captured, costs, crossing_bytes(captured), output_bytes)


def _state_bytes(
    search: Search, names: set[str] | frozenset[str], optimizer_state: float
) -> tuple[int, int, int]:
    params = sum(
        tensor_bytes(search.captured.tensors[n])
        for n in names
        if n in search.captured.parameter_names
    )
    buffers = sum(
        tensor_bytes(search.captured.tensors[n])
        for n in names
        if n not in search.captured.parameter_names
    )
    return params, buffers, int(optimizer_state * params)


def choose_cuts(
    search: Search,
    *,
    stages: int,
    microbatches: int,
    schedule: str,
    budget: int | None,
    optimizer_state: float,
    bandwidth: float | None,
    refused: frozenset[tuple[int, int, int]] = frozenset(),
) -> list[int]:
    """Node positions of the ``stages - 1`` cuts minimising the predicted step (exact).

    ``refused``: ``(stage, first node, end node)`` spans memfit's planner could not fit in the
    budget although the search's model said they would; the search avoids them.
    """
    costs = search.costs
    n = costs.count
    if stages > n:
        raise ValueError(
            f"{stages} stages need {stages} pieces, but the model has only {n} between its "
            f"{n - 1} candidate cuts (module boundaries)"
        )
    bounds = costs.boundaries
    last = bounds[-1]
    fwd = [0.0]
    act = [0]
    for f, a in zip(costs.forward_seconds, costs.activation_bytes):
        fwd.append(fwd[-1] + f)
        act.append(act[-1] + a)

    def sent(j: int) -> int:
        return search.crossing[bounds[j]] if bounds[j] < last else search.output_bytes

    def received(i: int) -> int:
        return search.crossing[bounds[i]] if i > 0 else 0

    def stage_time(i: int, j: int) -> float:
        transfer = 2 * sent(j) / bandwidth if bandwidth and j < n else 0.0
        return TRAINING_FACTOR * (fwd[j] - fwd[i]) + transfer

    # state held by a stage over items [i, j): a union of names, summed once per interval
    held: dict[tuple[int, int], int] = {}
    grads: dict[tuple[int, int], int] = {}
    for i in range(n):
        names: set[str] = set()
        total = params_total = 0
        for j in range(i + 1, n + 1):
            new = costs.state[j - 1] - names
            if new:
                params, buffers, opt = _state_bytes(search, new, optimizer_state)
                total += params + buffers + opt
                params_total += params
                names |= new
            held[i, j] = total
            grads[i, j] = params_total

    over = float(budget or 0) + 1.0

    def stage_memory(s: int, i: int, j: int) -> float:
        if (s, bounds[i], bounds[j]) in refused:
            return over
        flight = in_flight(schedule, s, stages, microbatches)
        # GPipe's stage: nothing kept but what crosses the cuts; one micro-batch's activations
        # (all recomputed) and its gradients while its backward runs
        transient = act[j] - act[i] + grads[i, j]
        return (
            held[i, j]
            + microbatches * (received(i) + (sent(j) if j < n else 0))
            + step_peak(schedule, microbatches, flight, sent(j), transient, grads[i, j])
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
        if refused:
            raise BudgetError(
                f"no split into {stages} stages fits {format_bytes(budget or 0)} per device: "
                f"memfit's planner could not fit {len(refused)} stage spans the search proposed, "
                "and no other split fits the search's own estimate",
                budget_bytes=budget,
            ) from None
        raise BudgetError(
            f"no split into {stages} stages fits {format_bytes(budget or 0)} per device, even "
            f"with every activation recomputed inside the stages; the smallest per-device "
            f"budget that fits is about {format_bytes(int(exc.least_capacity))}",
            budget_bytes=budget,
            smallest_bytes=int(math.ceil(exc.least_capacity)),
        ) from None
    cuts, pos = [], 0
    for size in sizes[:-1]:
        pos += size
        cuts.append(bounds[pos])
    return cuts


def stage_inputs(
    stages: Sequence[StageGraph], micro: tuple[Any, ...], captured: CapturedForward
) -> list[tuple[torch.Tensor, ...]]:
    """Real example inputs of every stage: the micro-batch run through the stages before it.

    Run without gradients and with buffers and random states restored, so it changes nothing.
    """
    values = {
        node: v
        for node, v in zip(captured.inputs, [t for t in micro if isinstance(t, torch.Tensor)])
    }
    result = []
    with preserved(captured.buffers), torch.no_grad():
        for stage in stages:
            args = tuple(values[v] for v in stage.receives)
            result.append(
                tuple(
                    a.detach().requires_grad_(bool(v.meta["example_value"].requires_grad))
                    if a.is_floating_point()
                    else a
                    for a, v in zip(args, stage.receives)
                )
            )
            out = stage.module(*args)
            if stage.sends:
                values.update(zip(stage.sends, out))
    return result


def _choose_point(
    frontier: Sequence[ParetoPoint], fits: Callable[[ParetoPoint], bool]
) -> ParetoPoint | None:
    fitting = [p for p in frontier if fits(p)]
    if not fitting:
        return None
    return min(fitting, key=lambda p: (p.recompute_seconds, p.recompute_flops, p.peak_bytes))


def plan_stage(
    search: Search,
    stage: StageGraph,
    inputs: tuple[torch.Tensor, ...],
    *,
    stages: int,
    microbatches: int,
    schedule: str,
    budget: int | None,
    optimizer_state: float,
    bandwidth: float | None,
    attention: str = "auto",
) -> StagePlan:
    """memfit's plan for one stage's graph: the least recomputation that fits the budget."""
    from memfit.execution.module import plan as memfit_plan

    names = set(stage.state_names)
    params, buffers, opt = _state_bytes(search, names, optimizer_state)
    last = stage.end == len(search.captured.nodes)
    send = search.output_bytes if last else stage.send_bytes
    receive = stage.receive_bytes if stage.index > 0 else 0
    flight = in_flight(schedule, stage.index, stages, microbatches)
    graph_plan = memfit_plan(stage.module, *inputs, budget=1.0, attention=attention)
    frontier = graph_plan.pareto()
    fixed = params + buffers + opt + microbatches * (receive + (0 if last else send))

    def peak_of(p: ParetoPoint) -> int:
        return step_peak(schedule, microbatches, flight, p.kept_bytes + send, p.peak_bytes, params)

    def fits(p: ParetoPoint) -> bool:
        if budget is None:
            return True
        return fixed + peak_of(p) <= budget

    point = _choose_point(frontier, fits)
    if point is None:
        least = min(fixed + peak_of(p) for p in frontier)
        raise BudgetError(
            f"stage {stage.index} ({stage.modules[0] if stage.modules else '?'} ..) does not fit "
            f"{format_bytes(budget or 0)}: its least predicted peak with memfit's plan is "
            f"{format_bytes(least)}",
            budget_bytes=budget,
            smallest_bytes=least,
        )
    # The frontier is a search; the plan ``checkpoint(budget=...)`` makes for that budget is
    # what runs (it may keep less): predict with that one.
    chosen = memfit_plan(stage.module, *inputs, budget=point.peak_bytes, attention=attention)
    costs = search.costs
    first_item = costs.boundaries.index(stage.start)
    last_item = costs.boundaries.index(stage.end)
    forward = sum(costs.forward_seconds[first_item:last_item])
    ratio = chosen.recompute_flops / chosen.forward_flops if chosen.forward_flops else 0.0
    transfer = 2 * send / bandwidth if bandwidth and not last else 0.0
    return StagePlan(
        index=stage.index,
        start=stage.start,
        end=stage.end,
        modules=tuple(stage.modules),
        parameter_bytes=params,
        buffer_bytes=buffers,
        optimizer_bytes=opt,
        receive_bytes=receive,
        send_bytes=send,
        in_flight=flight,
        microbatches=microbatches,
        kept_bytes=chosen.kept_bytes,
        transient_bytes=chosen.predicted_peak_bytes,
        forward_seconds=forward,
        recompute_seconds=ratio * forward,
        transfer_seconds=transfer,
        budget_bytes=point.peak_bytes,
        is_last=last,
        schedule=schedule,
    )


#: how many stage spans memfit's planner may refuse before the search gives up
MAX_REFUSALS = 16


def refuse(
    refused: set[tuple[int, int, int]], stage: StageGraph, err: BudgetError, stages: int
) -> None:
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
            smallest_bytes=err.smallest_bytes,
        )


def plan(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    *,
    stages: int,
    microbatches: int,
    schedule: str = "gpipe",
    budget: int | str | None = None,
    optimizer_state: float = 0.0,
    bandwidth: float | None = None,
    max_items: int = 128,
) -> PipelinePlan:
    """Plan ``model`` as a pipeline of ``stages`` stages and ``microbatches`` micro-batches.

    ``example_inputs`` (a tensor or a tuple of the model's positional arguments) is one
    mini-batch; it is split into equal micro-batches along dim 0. ``budget`` is bytes per
    device (``"2GiB"``); raises ``memfit.BudgetError`` naming the least budget when no split
    fits, and ``ValueError`` for arguments no pipeline can honour, before anything runs.
    ``loss_fn`` is not needed to plan (the loss runs after the last stage); it is accepted so
    ``plan`` and ``Pipeline`` take the same arguments. Changes nothing in the model.
    """
    del loss_fn
    check_arguments(stages, microbatches, schedule, optimizer_state)
    budget_bytes = budget_per_device(budget)
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    micro = microbatch(inputs, microbatches)
    search = prepare_search(model, micro, max_items)
    options = dict(
        stages=stages,
        microbatches=microbatches,
        schedule=schedule,
        budget=budget_bytes,
        optimizer_state=optimizer_state,
        bandwidth=bandwidth,
    )
    refused: set[tuple[int, int, int]] = set()
    while True:
        cuts = choose_cuts(search, refused=frozenset(refused), **options)  # type: ignore[arg-type]
        graphs = split_stages(search.captured, cuts)
        examples = stage_inputs(graphs, micro, search.captured)
        planned: list[StagePlan] = []
        for g, x in zip(graphs, examples):
            try:
                planned.append(plan_stage(search, g, x, **options))  # type: ignore[arg-type]
            except BudgetError as err:
                refuse(refused, g, err, stages)
                break
        else:
            break
    return PipelinePlan(
        stages=tuple(planned),
        schedule=schedule,
        microbatches=microbatches,
        cuts=tuple(cuts),
        budget_bytes=budget_bytes,
        candidate_cuts=search.costs.count - 1,
    )
