"""``memfit.pipeline.Pipeline``: this rank's stages, run by ``torch.distributed.pipelining``.

memfit decides the cut and each stage's plan; PyTorch runs the schedule. Every rank builds the
whole model (as with any ``torch.distributed`` program), captures it the same way and splits it
at the same cuts; rank 0 alone profiles and searches, and broadcasts the cuts, so ranks whose
timings differ cannot disagree on the split. Each rank then plans its own stages (one, or
several where the schedule places them so: ``placement``) with memfit's planner, wraps each in
``memfit.checkpoint`` with that plan's budget, and hands them to ``PipelineStage`` objects driven
by the torch schedule of the same name (point-to-point over gloo on CPU, NCCL on CUDA).

Two things ``torch.distributed.pipelining`` leaves to its user are done here. A parameter read
by several stages (a tied embedding and LM head) exists once per stage that reads it; after the
schedule's backward its gradients are summed over those ranks, which is the gradient plain
PyTorch computes for a tied weight. And the schedule divides gradients by ``M`` (its
``scale_grads``), so with a loss that averages over its micro-batch the gradients are those of
the mean loss over the whole mini-batch, as plain PyTorch computes them on the mini-batch. The
loss is recomputed in each micro-batch's backward (NOTE [The loss holds nothing between a
micro-batch's forward and backward]).

Dropout draws from each rank's own generator, micro-batch after micro-batch, so the masks are
not those one process would draw for the whole model (no pipeline can reproduce one process's
random stream without running every stage before it); they are the masks that running the same
stages one after another in one process, each stage seeded as its rank is, draws (a rank with
several stages gives each its own stream: ``streams.OwnStream``). BatchNorm
sees micro-batches, as in GPipe: its statistics are those of ``M`` plain-PyTorch steps on the
micro-batches, not of one step on the mini-batch.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.utils.checkpoint import checkpoint as recompute

from memfit.execution.module import checkpoint
from memfit.execution.options import Options
from memfit.execution.state import preserved
from memfit.measurement import measure
from memfit.measurement.cpu import cpu_recording_blocked
from memfit.pipeline.candidates import Candidate
from memfit.pipeline.costs import Search, measure_items, prepare_search
from memfit.pipeline.cut_search import Span, StagesFound, choose_cuts, search_stages
from memfit.pipeline.partition import StageGraph
from memfit.pipeline.pipeline_options import (
    Configuration,
    PipelineOptions,
    configure,
    deprecated_keywords,
    is_auto,
    microbatch,
)
from memfit.pipeline.placement import local_stages, stage_ranks
from memfit.pipeline.plan_pipeline import plan
from memfit.pipeline.schedule import PipelineSchedule, is_single, splits_backward
from memfit.pipeline.stages import StagePlan, rank_step_peak_bytes
from memfit.pipeline.streams import OwnStream, set_rng_state
from memfit.planning.budget import BudgetError

__all__ = ["Pipeline"]

#: The ``torch.distributed.pipelining`` schedule that runs each of memfit's.
_TORCH_SCHEDULES: dict[PipelineSchedule, Any] = {
    PipelineSchedule.GPIPE: ScheduleGPipe,
    PipelineSchedule.ONE_F_ONE_B: Schedule1F1B,
    PipelineSchedule.INTERLEAVED_1F1B: ScheduleInterleaved1F1B,
    PipelineSchedule.LOOPED_BFS: ScheduleLoopedBFS,
    PipelineSchedule.INTERLEAVED_ZERO_BUBBLE: ScheduleInterleavedZeroBubble,
    PipelineSchedule.ZBV_ZERO_BUBBLE: ScheduleZBVZeroBubble,
    PipelineSchedule.DUALPIPEV: ScheduleDualPipeV,
}


# NOTE [Zero-bubble schedules and memfit's one-piece backward]
# Zero-bubble schedules (``splits_backward``) run each backward as two steps, the input
# gradients ("I", sent upstream at once) and the weight gradients ("W", deferred into the
# bubble); torch splits an eager autograd graph for them (``stage_backward_input`` /
# ``stage_backward_weight``). A stage memfit runs is one AOTAutograd function whose backward
# makes both at once: split, the W step would run that whole backward a second time on a
# retained graph. So such a stage is given a ``dw_builder`` (torch 2.13's hook for a custom
# weight step): the I step runs the whole backward, input and weight gradients together, and the
# W step has nothing left to do. Gradients are exact and nothing is held until W; the W slots
# of the schedule stay empty, so its bubble is 1F1B's rather than zero.
def _nothing_left() -> Callable[[], None]:
    return lambda: None


def _example(node: Any) -> torch.Tensor:
    """An empty tensor shaped like a graph value, requiring grad where the value does."""
    value = node.meta["example_value"]
    out = torch.empty(value.shape, dtype=value.dtype)
    return out.requires_grad_(bool(value.requires_grad) and value.is_floating_point())


class Pipeline:
    """This rank's stages of ``model`` in a pipeline over ``ranks`` ranks; see the module
    docstring.

    Call after ``torch.distributed.init_process_group`` in every rank (``ranks`` ranks in the
    group), with the same model (same initial parameters), example mini-batch and
    ``PipelineOptions`` everywhere (the options ``plan`` took: the same search runs).
    ``pipe.step(*inputs, target=target)`` runs one training step's forward and backward over
    ``options.microbatches`` micro-batches and returns the mean loss (on every rank); rank 0's
    inputs and the last rank's target are used, the others may pass anything.
    ``named_parameters()`` are this rank's parameters under their names in ``model``: build the
    optimizer on them. Parameters of other stages are released on this rank (their storage is
    freed) unless ``release_others=False``, so each device holds only its stages. The keywords
    of memfit 0.1 (``stages=K``, ``microbatches=``, ...) are accepted until the next release,
    with a ``DeprecationWarning`` giving the new spelling.
    """

    def __init__(
        self,
        model: nn.Module,
        example_inputs: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        *,
        ranks: int | None = None,
        options: PipelineOptions | None = None,
        group: dist.ProcessGroup | None = None,
        release_others: bool = True,
        **deprecated: Any,
    ) -> None:
        ranks, options = deprecated_keywords("Pipeline", ranks, options, deprecated)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "memfit.pipeline.Pipeline runs one rank per process: call "
                "torch.distributed.init_process_group first (memfit.pipeline.launch does it for "
                "local runs)"
            )
        self._group = group
        #: under ``schedule="auto"``, every configuration rank 0 compared (else empty)
        self.candidates: tuple[Candidate, ...] = ()
        if is_auto(options.schedule):
            options = self._choose(model, example_inputs, ranks, options)
        config = configure(ranks, options)
        world = dist.get_world_size(group)
        if world != ranks:
            raise ValueError(
                f"a pipeline over {ranks} ranks needs a process group of {ranks}; the process "
                f"group has {world}: pass ranks={world} or a group of {ranks}"
            )
        #: this rank, K (the ranks), and the options it runs (``"auto"``'s choices in them)
        self.rank, self.ranks, self.options = dist.get_rank(group), ranks, options
        #: the rank of every stage, and the stages this rank holds (increasing)
        self._placed = stage_ranks(config.schedule, ranks, config.stages_per_rank)
        self.local_stages = local_stages(config.schedule, ranks, config.stages_per_rank, self.rank)
        self.microbatches = config.microbatches
        self.schedule_name = config.schedule
        self._loss_fn = loss_fn
        self._no_target = False
        self._loss_measured = False
        inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
        search, found = self._find_stages(model, inputs, config, options.max_items)
        self._captured = search.captured
        #: this rank's stages' plans, graphs and modules, in ``local_stages`` order
        self.plans: list[StagePlan] = [found.plans[s] for s in self.local_stages]
        self.graphs: list[StageGraph] = [found.graphs[s] for s in self.local_stages]
        self._examples = [found.examples[s] for s in self.local_stages]
        self.modules = self._checkpointed(config.offload)
        #: the first of this rank's stages (its only one under GPipe and 1F1B)
        self.graph, self.module = self.graphs[0], self.modules[0]
        self._device = next(
            (t.device for t in search.captured.tensors.values()), torch.device("cpu")
        )
        self._streams = (
            [OwnStream(m, self._device) for m in self.modules] if len(self.modules) > 1 else []
        )
        output_node = next(iter(search.captured.graph.graph.find_nodes(op="output")))
        self._outputs = list(output_node.all_input_nodes)
        self._last_stage = config.stages - 1
        self._stages = self._pipeline_stages(config, found.examples[0])
        self._schedule = _TORCH_SCHEDULES[config.schedule](
            self._stages[0] if is_single(config.schedule) else self._stages,
            config.microbatches,
            loss_fn=self._loss,
            scale_grads=True,
        )
        self._input_positions = [search.captured.inputs.index(v) for v in found.graphs[0].receives]
        self._tied = self._tie(found.graphs)
        if release_others:
            self._release(model, {n for g in self.graphs for n in g.state_names})

    def _find_stages(
        self, model: nn.Module, inputs: tuple[Any, ...], config: Configuration, max_items: int
    ) -> tuple[Search, StagesFound]:
        """Capture and profile the model, and run the cut search (``cut_search.search_stages``):
        rank 0 chooses the cuts, each rank plans its own stages, and every rank refuses the
        spans any rank's planner could not fit."""
        micro = microbatch(inputs, config.microbatches)
        # Every rank captures and measures bytes; only rank 0's times count, taken while the
        # other ranks wait (on 2 cores, ranks profiling at once time each other's contention).
        search = prepare_search(model, micro, max_items, repeats=1)
        dist.barrier(group=self._group)
        if self.rank == 0:
            search.costs = measure_items(
                search.captured, search.captured.placeholder_values, search.costs.boundaries
            )
        found = search_stages(
            search,
            micro,
            config,
            planned_here=self.local_stages,
            choose=lambda refused: self._agree_on_cuts(search, config, refused),
            share=lambda failed: self._share_refusals(failed, config.budget),
        )
        return search, found

    def _checkpointed(self, offload: bool) -> list[nn.Module]:
        """This rank's stage graphs under ``memfit.checkpoint`` at their plans' budgets.

        What a stage holds between its forwards and backwards (other micro-batches) is in the
        pipeline's own memory model: the stage must not measure and replan for it."""
        return [
            checkpoint(
                g.module,
                p.budget_bytes,
                offload=offload,
                options=Options(measure_outside=False),
            )
            for g, p in zip(self.graphs, self.plans)
        ]

    def _pipeline_stages(
        self, config: Configuration, first_inputs: tuple[torch.Tensor, ...]
    ) -> list[PipelineStage]:
        """A ``PipelineStage`` for each of this rank's stages, its inputs and outputs shaped as
        one micro-batch's (``first_inputs``: the first stage's example inputs)."""
        split = splits_backward(config.schedule)
        stages = []
        for s, graph, run in zip(self.local_stages, self.graphs, self._streams or self.modules):
            if s == 0:
                input_args = tuple(first_inputs)
            else:
                input_args = tuple(_example(v) for v in graph.receives)
            sends = self._outputs if s == self._last_stage else graph.sends
            stages.append(
                PipelineStage(
                    run,
                    s,
                    config.stages,
                    self._device,
                    input_args=input_args,
                    output_args=tuple(_example(v) for v in sends),
                    group=self._group,
                    dw_builder=_nothing_left if split else None,
                )
            )
        return stages

    def _choose(
        self, model: nn.Module, example_inputs: Any, ranks: int, options: PipelineOptions
    ) -> PipelineOptions:
        """``schedule="auto"``: rank 0 plans every configuration (``auto``) while the others
        wait, and every rank gets its choice, or its error, so all fail alike."""
        payload: list[Any] = [None]
        if dist.get_rank(self._group) == 0:
            try:
                chosen = plan(model, example_inputs, ranks=ranks, options=options)
                payload[0] = (
                    "ok",
                    (chosen.schedule, chosen.stages_per_rank, chosen.microbatches),
                    chosen.candidates,
                )
            except (BudgetError, ValueError) as exc:
                payload[0] = (type(exc).__name__, str(exc), getattr(exc, "least_bytes", None))
        dist.broadcast_object_list(payload, src=self._global_rank(0), group=self._group)
        kind, first, second = payload[0]
        if kind == "BudgetError":
            raise BudgetError(first, budget_bytes=None, least_bytes=second)
        if kind != "ok":
            raise ValueError(first)
        self.candidates = second
        schedule, per_rank, microbatches = first
        return dataclasses.replace(
            options, schedule=schedule, stages_per_rank=per_rank, microbatches=microbatches
        )

    @property
    def stages(self) -> int:
        """Deprecated: ``ranks`` (this attribute counted ranks, not stages)."""
        warnings.warn(
            "Pipeline.stages is deprecated and will be removed in the next release: it counts "
            "ranks, read Pipeline.ranks",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.ranks

    @property
    def plan(self) -> StagePlan:
        """The first of this rank's stages' plans (its only one under GPipe and 1F1B)."""
        return self.plans[0]

    @property
    def predicted_step_peak_bytes(self) -> int:
        """This rank's predicted peak above what is live before a step (all its stages')."""
        return rank_step_peak_bytes(self.plans, self.ranks)

    def _global_rank(self, group_rank: int) -> int:
        if self._group is None:
            return group_rank
        return dist.get_global_rank(self._group, group_rank)

    def _agree_on_cuts(
        self, search: Search, config: Configuration, refused: frozenset[Span]
    ) -> list[int]:
        """Rank 0 searches; every rank gets its cuts, or its error, so all fail alike."""
        payload: list[Any] = [None]
        if self.rank == 0:
            try:
                cuts = choose_cuts(search, config, refused)
                payload[0] = ("ok", cuts, search.costs.forward_seconds)
            except (BudgetError, ValueError) as exc:
                smallest = getattr(exc, "least_bytes", None)
                payload[0] = (type(exc).__name__, str(exc), smallest)
        dist.broadcast_object_list(payload, src=self._global_rank(0), group=self._group)
        kind, *rest = payload[0]
        if kind == "ok":
            search.costs = dataclasses.replace(search.costs, forward_seconds=list(rest[1]))
            return list(rest[0])
        if kind == "BudgetError":
            raise BudgetError(rest[0], budget_bytes=config.budget, least_bytes=rest[1])
        raise ValueError(rest[0])

    def _share_refusals(
        self, failed: dict[int, BudgetError], budget: int | None
    ) -> dict[int, BudgetError]:
        """Every rank's refusals of its stages, on every rank, so all search again alike."""
        mine = {s: (str(e), e.least_bytes) for s, e in failed.items()}
        gathered: list[Any] = [None] * self.ranks
        dist.all_gather_object(gathered, mine, group=self._group)
        return {
            s: BudgetError(f[0], budget_bytes=budget, least_bytes=f[1])
            for failures in gathered
            for s, f in failures.items()
        }

    def _tie(self, graphs: list[StageGraph]) -> list[tuple[nn.Parameter, Any]]:
        """Process groups over the ranks sharing each tied parameter (created on every rank).

        Two stages on the same rank share the parameter itself, whose gradient accumulates both
        stages' there: only ranks are summed over."""
        names = self._captured.parameter_names
        tied: list[tuple[nn.Parameter, Any]] = []
        seen: dict[tuple[int, ...], Any] = {}
        for name in sorted(names):
            ranks = tuple(
                sorted({self._placed[s] for s, g in enumerate(graphs) if name in g.state_names})
            )
            if len(ranks) < 2:
                continue
            if ranks not in seen:
                seen[ranks] = dist.new_group([self._global_rank(r) for r in ranks])
            if self.rank in ranks:
                param = self._captured.tensors[name]
                assert isinstance(param, nn.Parameter)
                tied.append((param, seen[ranks]))
        return tied

    def _release(self, model: nn.Module, keep: set[str]) -> None:
        kept = {id(self._captured.tensors[n]) for n in keep}
        for p in model.parameters():
            if id(p) not in kept:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        flat = output if isinstance(output, tuple) else (output,)
        if self._no_target:
            target = None
        # NOTE [The loss holds nothing between a micro-batch's forward and backward]
        # A last stage keeps every micro-batch in flight until its backward, and each one's loss
        # with it. What a loss saves for its backward is the user's code, unknown to the plan
        # (``F.cross_entropy`` saves its log-softmax, as large as the logits; ``F.mse_loss``
        # only its inputs): under GPipe ``M - 1`` of them sat beside the first backward, which
        # the stage model did not count (TinyGPT's last stage measured 7,712 B, 3 x 2,560 B of
        # logits, above its prediction). Recomputed in its backward instead, the loss holds only
        # what it reads, the stage's outputs (counted) and the target (the schedule's chunk), at
        # the cost of one loss forward per micro-batch.
        loss = recompute(self._loss_of, flat, target, use_reentrant=False, preserve_rng_state=False)
        # The schedule keeps every micro-batch's loss until the step ends. A loss whose storage
        # is larger than its value (``F.mse_loss``'s returns its unreduced buffer, one
        # micro-batch's outputs, on torch 2.13) would keep that buffer too; a copy keeps the value.
        if type(loss) is torch.Tensor and loss.untyped_storage().nbytes() > loss.nbytes:
            loss = loss.clone()
        return loss

    def _measure_loss(self, target: Any) -> None:
        """The last stage's ``loss_bytes``: the loss's forward and backward on one micro-batch
        (outputs shaped as the stage's, the target's first chunk as the schedule splits it),
        measured once, at the first step, the first time the target is known.

        On CPU, memory is counted by a profiler session, and only one may run: inside the
        user's (``memfit.measure`` or ``torch.profiler.profile`` around the step) a second would
        raise or corrupt theirs. There the measurement waits for the first step run outside any
        session; ``loss_bytes`` stays 0 until then (what ``plan`` predicts). The step itself does
        not depend on it: it only enters the predicted peak.
        """
        if self._device.type == "cpu" and cpu_recording_blocked() is not None:
            return
        outputs = tuple(_example(v) for v in self._outputs)
        chunk = target.tensor_split(self.microbatches)[0] if torch.is_tensor(target) else target

        def loss_step() -> None:
            loss = self._loss_of(outputs, None if self._no_target else chunk)
            grads = [o for o in outputs if o.requires_grad]
            if loss.requires_grad and grads:
                # outputs the loss does not read (GPT-2's key/value cache beside its logits)
                # get no gradient, as in the schedule's backward
                torch.autograd.grad(loss, grads, allow_unused=True)

        with torch.no_grad():
            for o in outputs:  # values for the loss to read (an empty tensor may hold NaNs),
                o.fill_(1)  # drawn from no generator: the rank's random stream stays as it is
        peak = measure(loss_step, device=self._device).peak_bytes or 0
        at = self.local_stages.index(self._last_stage)
        self.plans[at] = dataclasses.replace(self.plans[at], loss_bytes=peak)
        self._loss_measured = True

    def _loss_of(self, flat: tuple[Any, ...], target: Any) -> torch.Tensor:
        return self._loss_fn(self._captured.rebuild_output(flat), target)

    def time_stage_alone(self, repeats: int = 3) -> float:
        """Median seconds of this rank's stages' forward and backward on one micro-batch, alone.

        No communication: what the rank's stages would take per micro-batch if its neighbours
        were infinitely fast, the "stage time" of the schedule's model (summed over the rank's
        stages when it holds several). Gradients it adds are removed again; buffers (BatchNorm
        statistics) and random states are restored.
        """
        grads = {p: None if p.grad is None else p.grad.clone() for p in self.parameters()}
        times = []
        try:
            with preserved([b for m in self.modules for b in m.buffers()]):
                for _ in range(repeats):
                    start = time.perf_counter()
                    for module, example in zip(self.modules, self._examples):
                        inputs = tuple(x.detach().requires_grad_(x.requires_grad) for x in example)
                        out = module(*inputs)
                        outs = out if isinstance(out, tuple) else (out,)
                        flat = [o for o in outs if o.requires_grad]
                        torch.autograd.backward(flat, [torch.ones_like(o) for o in flat])
                    times.append(time.perf_counter() - start)
        finally:
            for p, g in grads.items():
                p.grad = g
        return statistics.median(times)

    def step(self, *inputs: Any, target: Any = None) -> torch.Tensor:
        """One forward and backward of the mini-batch; gradients accumulate into ``.grad``."""
        losses: list[torch.Tensor] = []
        first, last = 0 in self.local_stages, self._last_stage in self.local_stages
        self._no_target = target is None
        if last and target is None:  # the schedule splits a target: give it one to split
            target = torch.zeros(self.microbatches)
        if last and not self._loss_measured:
            self._measure_loss(target)
        args = tuple(inputs[i] for i in self._tensor_inputs(inputs)) if first else ()
        for stream in self._streams:
            stream.start()
        # the last stage's outputs are not kept to be merged and returned (``step`` returns the
        # loss only): each is freed with its backward, as the memory model has it
        if first and last:
            self._schedule.step(*args, target=target, losses=losses, return_outputs=False)
        elif first:
            self._schedule.step(*args, return_outputs=False)
        elif last:
            self._schedule.step(target=target, losses=losses, return_outputs=False)
        else:
            self._schedule.step(return_outputs=False)
        if self._streams:  # the rank's generator moves on as its first stage's stream did
            assert self._streams[0].state is not None
            set_rng_state(self._device, self._streams[0].state)
        for param, group in self._tied:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, group=group)
        loss = torch.zeros((), dtype=torch.float32, device=self._device)
        if last:
            loss.copy_(torch.stack([x.detach().float() for x in losses]).mean())
        src = self._global_rank(self._placed[self._last_stage])
        dist.broadcast(loss, src=src, group=self._group)
        return loss

    def _tensor_inputs(self, inputs: tuple[Any, ...]) -> list[int]:
        tensors = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)]
        if len(tensors) != len(self._captured.inputs):
            raise ValueError(
                f"the pipeline was planned with {len(self._captured.inputs)} tensor inputs, "
                f"got {len(tensors)}"
            )
        return [tensors[i] for i in self._input_positions]

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under their names in the model (a parameter two of its
        stages share, once)."""
        seen: set[str] = set()
        for module in self.modules:
            for name, param in module.named_parameters():
                if name not in seen:
                    seen.add(name)
                    yield name, param

    def parameters(self) -> Iterator[nn.Parameter]:
        return (p for _, p in self.named_parameters())

    def state_dict(self) -> dict[str, Any]:
        """This rank's parameters and buffers under their names in the model."""
        merged: dict[str, Any] = {}
        for module in self.modules:
            merged.update(module.state_dict())
        return merged
