"""Stage plans: what each stage of a pipeline keeps, holds and costs, and how one is planned.

Each stage gets memfit's own plan: the stage's graph is planned by memfit's planner (its Pareto
frontier of peak against recomputation), and the point with the least recomputation whose
predicted peak, with the other micro-batches in flight, fits the per-device budget is kept
(re-planned at that budget, which may keep less: its numbers are the prediction). Without a
budget every stage keeps everything (the fastest plan).

What a stage holds, in the terms of the table ``PipelinePlan`` prints (per device):

* state: its parameters and buffers, their gradients, and the optimizer state if given
  (``optimizer_state`` bytes per parameter byte: 2 for Adam, 1 for SGD with momentum);
* buffers: ``torch.distributed.pipelining`` allocates a receive buffer for every micro-batch's
  input and every micro-batch's output gradient when the schedule first runs, and keeps them,
  so ``M x (received + sent)`` bytes whatever the schedule;
* in flight: micro-batches whose forward has run and whose backward has not, each holding what
  the stage's plan keeps plus its outputs: ``M`` of them under GPipe, at most ``K - s`` under
  1F1B (stage ``s``; ``schedule.in_flight``);
* the transient of one micro-batch's forward and backward, as memfit's simulator predicts it,
  and from the second backward on the gradients accumulated so far beside the new ones;
* what torch's send handles still hold beside a backward: earlier micro-batches' outputs and
  input gradients (``schedule.held_at_backward``); the peak is the largest backward's
  (``schedule.step_peak``).

Time per micro-batch is profiled forward time times three (forward, backward at twice the
forward) plus the recomputation the plan does and the time its compute waits for offloaded values
(``offload``), plus, when ``bandwidth`` is given, the transfer of what crosses the stage's
outgoing cut forward and its gradient back. ``stage_planner`` makes the plans.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from memfit.execution.state import preserved
from memfit.pipeline.balancing import pipeline_step_time
from memfit.pipeline.candidates import Candidate, candidate_table
from memfit.pipeline.costs import TRAINING_FACTOR
from memfit.pipeline.partition import CapturedForward, StageGraph
from memfit.pipeline.rank_model import StageSizes, rank_step_peak
from memfit.pipeline.schedule import (
    PipelineSchedule,
    equal_stages_bubble,
    is_single,
    step_peak,
)
from memfit.pipeline.timeline import simulate_step
from memfit.units import format_bytes

__all__ = [
    "PipelinePlan",
    "StagePlan",
    "rank_peak",
    "rank_step_peak_bytes",
    "stage_inputs",
]


@dataclass(frozen=True)
class StagePlan:
    """One stage's cut, plan and prediction. Bytes are per device; times per micro-batch."""

    index: int
    #: K: the pipeline's stages (where this one stands decides what the schedule holds)
    stages: int
    start: int
    end: int
    modules: tuple[str, ...]
    parameter_bytes: int
    buffer_bytes: int
    optimizer_bytes: int
    receive_bytes: int
    send_bytes: int
    #: the gradients of what the stage receives, sent back per micro-batch (0 on the first)
    receive_grad_bytes: int
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
    schedule: PipelineSchedule = PipelineSchedule.GPIPE
    #: the rank (device) that holds this stage (``placement.stage_ranks``)
    rank: int = 0
    #: what the plan offloads per micro-batch, and the seconds its compute waits for the link
    offloaded_bytes: int = 0
    stall_seconds: float = 0.0
    #: the last stage: the peak of the loss's forward and backward on one micro-batch (measured
    #: by ``Pipeline`` at its first step, which has the target; 0 until then, and in ``plan``)
    loss_bytes: int = 0

    @property
    def first_module(self) -> str:
        return self.modules[0] if self.modules else ""

    @property
    def last_module(self) -> str:
        return self.modules[-1] if self.modules else ""

    @property
    def time_seconds(self) -> float:
        """Forward, backward, recomputation, offload stall and transfer of one micro-batch."""
        return (
            TRAINING_FACTOR * self.forward_seconds
            + self.recompute_seconds
            + self.stall_seconds
            + self.transfer_seconds
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
        holding what the plan keeps and its outputs; from the second backward on, the
        gradients accumulated so far, alive beside the new ones the backward makes; and what
        torch's schedule still holds in send handles, earlier micro-batches' outputs and input
        gradients. The peak is the largest over the step's backwards
        (``schedule.held_at_backward`` counts each term per backward, from torch's schedules):
        under GPipe the first backward, with ``M - 1`` others in flight, unless the sends held
        outweigh them; under 1F1B a steady-state backward, with ``in_flight - 1`` others, the
        gradients, the previous input gradients and (before the pipe drains) one output the
        warm-up sent. From the second backward on, the new gradients ``transient_bytes``
        counts are added into the accumulated ones and freed, so the peak may be up to one
        layer's gradients lower than predicted.
        """
        return step_peak(
            self.schedule,
            self.index,
            self.stages,
            self.microbatches,
            **dataclasses.asdict(self.sizes),
        )

    @property
    def micro_peak_bytes(self) -> int:
        """One micro-batch's forward and backward: memfit's prediction for the stage's graph,
        or, on the last stage, what the micro-batch keeps with its outputs and the loss's own
        forward and backward on them (the loss runs first in the backward), if that is more."""
        if not self.loss_bytes:
            return self.transient_bytes
        return max(self.transient_bytes, self.kept_bytes + self.send_bytes + self.loss_bytes)

    @property
    def peak_bytes(self) -> int:
        """Everything the stage's device holds at the peak of a step (when its rank holds
        several stages, GPipe's bound of this one's share: ``rank_peak`` is the rank's)."""
        return self.held_bytes + self.step_peak_bytes

    @property
    def held_bytes(self) -> int:
        """What the stage holds between steps: state and the schedule's receive buffers."""
        return self.parameter_bytes + self.buffer_bytes + self.optimizer_bytes + self.buffers_bytes

    @property
    def sizes(self) -> StageSizes:
        """This stage's part in its rank's step, for ``rank_model.rank_step_peak``."""
        return StageSizes(
            each=self.kept_bytes + self.send_bytes,
            transient=self.micro_peak_bytes,
            grads=self.parameter_bytes,
            sent=self.send_bytes,
            input_grad=self.receive_grad_bytes,
        )


def rank_step_peak_bytes(plans: Sequence[StagePlan], ranks: int) -> int:
    """The peak above what is live before a step of the rank holding ``plans`` (all its
    stages; ``rank_model.rank_step_peak``)."""
    first = plans[0]
    return rank_step_peak(
        first.schedule,
        ranks,
        len(plans),
        first.microbatches,
        first.rank,
        {p.index: p.sizes for p in plans},
    )


def rank_peak(plans: Sequence[StagePlan], ranks: int) -> int:
    """Everything the rank holding ``plans`` holds at the peak of a step."""
    return sum(p.held_bytes for p in plans) + rank_step_peak_bytes(plans, ranks)


@dataclass(frozen=True)
class PipelinePlan:
    """Stage boundaries, per-stage predictions and the predicted step of the schedule."""

    stages: tuple[StagePlan, ...]
    schedule: PipelineSchedule
    microbatches: int
    cuts: tuple[int, ...]
    budget_bytes: int | None
    candidate_cuts: int
    #: stages each rank holds: the plan has ``stages_per_rank x K`` stages on K ranks
    stages_per_rank: int = 1
    #: under ``schedule="auto"``, every configuration compared, the chosen one among them
    candidates: tuple[Candidate, ...] = ()
    #: ``PipelineOptions.overhead`` and ``latency``, in the predicted step
    overhead: float = 0.0
    latency: float = 0.0

    @property
    def step_seconds(self) -> float:
        """Predicted step: ``(M - 1) * slowest stage + sum of stages`` under GPipe and 1F1B,
        each stage's time with the runtime's ``overhead`` on its forward and backward, and a
        micro-batch's ``latency`` at each cut, there and back; simulated on torch's order under
        the others (``timeline.simulate_step``)."""
        if self._simulated is not None:
            return self._simulated[0]
        times = [s.time_seconds + 2 * self.overhead for s in self.stages]
        hops = 2 * (len(times) - 1) * self.latency
        return pipeline_step_time(times, [1] * len(times), microbatches=self.microbatches) + hops

    @property
    def bubble(self) -> float:
        """Idle share of the devices' time: ``1 - M * mean stage time / step`` (the runtime's
        overhead counts as idle); for equal stages under GPipe and 1F1B, without overhead and
        latency, ``(K - 1) / (M + K - 1)``."""
        if self._simulated is not None:
            return self._simulated[1]
        step = self.step_seconds
        busy = self.microbatches * sum(s.time_seconds for s in self.stages)
        return max(0.0, 1.0 - busy / (len(self.stages) * step)) if step > 0 else 0.0

    @property
    def _simulated(self) -> tuple[float, float] | None:
        if is_single(self.schedule):
            return None
        return simulate_step(
            self.schedule,
            self.ranks,
            self.stages_per_rank,
            self.microbatches,
            [s.forward_seconds for s in self.stages],
            [s.time_seconds - s.forward_seconds for s in self.stages],
            overhead=self.overhead,
            latency=self.latency,
        )

    @property
    def ranks(self) -> int:
        """K: the ranks (devices)."""
        return len(self.stages) // self.stages_per_rank

    def rank_stages(self, rank: int) -> list[StagePlan]:
        """The stages rank ``rank`` holds, in increasing order."""
        return [s for s in self.stages if s.rank == rank]

    @property
    def rank_peaks(self) -> list[int]:
        """Every rank's peak (``rank_peak``), by rank."""
        return [rank_peak(self.rank_stages(r), self.ranks) for r in range(self.ranks)]

    @property
    def peak_bytes(self) -> int:
        """The largest rank's peak."""
        return max(self.rank_peaks)

    def __str__(self) -> str:
        k = len(self.stages)
        budget = format_bytes(self.budget_bytes) if self.budget_bytes else "none"
        placed = (
            ""
            if self.stages_per_rank == 1
            else f" ({self.stages_per_rank} per rank on {k // self.stages_per_rank} ranks)"
        )
        lines = [
            f"memfit pipeline: {k} stages{placed}, {self.microbatches} micro-batches, "
            f"{self.schedule}, budget {budget} per device "
            f"({self.candidate_cuts} candidate cuts)",
            f"{'stage':>5} {'rank':>4} {'time/mb':>9} {'state':>10} {'buffers':>10} "
            f"{'in flight':>9} {'kept/mb':>10} {'peak':>10}  modules",
        ]
        for s in self.stages:
            span = (
                s.first_module
                if s.first_module == s.last_module
                else (f"{s.first_module} .. {s.last_module}")
            )
            lines.append(
                f"{s.index:>5} {s.rank:>4} {s.time_seconds * 1e3:>7.2f}ms "
                f"{format_bytes(s.state_bytes):>10} {format_bytes(s.buffers_bytes):>10} "
                f"{s.in_flight:>9} {format_bytes(s.kept_bytes):>10} "
                f"{format_bytes(s.peak_bytes):>10}  {span}"
            )
        lines.append(
            f"predicted step {self.step_seconds * 1e3:.2f} ms, bubble {self.bubble:.1%} "
            f"((K-1)/(M+K-1) = {equal_stages_bubble(self.ranks, self.microbatches):.1%}), "
            f"largest rank peak {format_bytes(self.peak_bytes)}"
        )
        if not is_single(self.schedule):
            peaks = ", ".join(format_bytes(p) for p in self.rank_peaks)
            lines.append(
                f"rank peaks {peaks}; rank peaks, step and bubble simulated on {self.schedule}'s "
                "order; stage peaks are GPipe's bound"
            )
        if any(s.offloaded_bytes for s in self.stages):
            offloaded = ", ".join(format_bytes(s.offloaded_bytes) for s in self.stages)
            lines.append(f"offloaded per micro-batch, by stage: {offloaded}")
        if self.candidates:
            lines.append(
                f"schedule='auto' compared {len(self.candidates)} configurations (predicted; "
                "V stages per rank, M micro-batches; added: recomputation and offload stall "
                "over compute; * chosen: the least step that fits):"
            )
            lines.append(candidate_table(self.candidates))
        return "\n".join(lines)


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
