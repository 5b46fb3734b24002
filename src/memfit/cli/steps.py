"""One training step per memfit policy, measured alike by ``memfit demo`` and ``memfit profile``.

A *step* is forward, loss, backward, with gradients set to ``None`` first (as
``optimizer.zero_grad()`` does), so each step allocates its gradients like a real one. Each
policy (``memfit.Policy``) is a method of ``memfit.bench.runner``, measured as the benchmarks
measure theirs:

1. wrap the model (``memfit.checkpoint``) and run one step: capture, plan, compile ("first step");
2. run one step under ``memfit.measure``: the exact peak and the memory timeline, with the end of
   the forward (loss included) marked so figures can show where backward starts;
3. time ``timing_runs`` steps without the memory profiler (it inflates CPU time), round-robin over
   the policies so a busy machine's slow moments are spread over all of them; the median is
   reported.

Every policy is applied to a shallow copy of the *same* model (``Workload.wrap``: the copies share
its parameters, buffers and submodules), so no tensor is copied. Dynamo is reset once before:
each copy has its own backend, so they coexist in
Dynamo's cache and none is recompiled while it is measured (a recompile is detected and reported).
The first error stops the command (``record_failures=False``): a CLI reports it, not a table.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import memfit
from memfit._compat import tree_flatten
from memfit.bench.runner import Method, Snapshot, first_step, measure_peak, time_interleaved
from memfit.cli.errors import CliError
from memfit.execution.largest_batch import model_loss
from memfit.measurement.resident import resident_bytes
from memfit.planning.plan import Plan
from memfit.planning.policy import Policy

__all__ = ["PolicyResult", "Workload", "default_loss", "resident_bytes", "run_policies"]


def default_loss(output: Any) -> torch.Tensor:
    """The scalar a generic training step backpropagates from the model's output.

    A scalar output is the loss; else a ``loss`` attribute or key holding a scalar (HuggingFace
    models given labels), as ``memfit.largest_batch`` reads it (``model_loss``); else the sum of
    every floating-point output tensor that requires grad (which backpropagates a gradient of
    ones of each output's shape, as large as a real loss's).
    """
    loss = model_loss(output)
    if loss is not None:
        return loss
    tensors = [
        t
        for t in tree_flatten(output)[0]
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()
    ]
    if not tensors:
        raise ValueError(
            f"the model's output ({type(output).__name__}) has no floating-point tensor that "
            "requires grad, so there is nothing to backpropagate; is the model in training mode "
            "with parameters that require grad?"
        )
    total = tensors[0].sum().float()
    for t in tensors[1:]:
        total = total + t.sum().float()
    return total


@dataclass
class Workload:
    """A model, the inputs of one step, and how its output becomes the loss."""

    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    loss: Callable[[Any], torch.Tensor] = default_loss
    #: where policies that offload put their activations (``--offload-to``, ``--offload-dir``)
    options: memfit.Options = field(default_factory=memfit.Options)
    #: how memfit runs its plans (``--executor``): ``"eager"`` kernels or Inductor's
    executor: str = "eager"

    def wrap(self, policy: Policy, model: nn.Module | None = None) -> nn.Module:
        """``memfit.checkpoint`` under ``policy`` of a view of the model (or ``model``).

        memfit applies to a model in place, once; the command line compares policies on one set
        of weights, so each policy gets a shallow copy (``copy.copy``: its own object, the
        model's parameter, buffer and submodule dictionaries), as several ``torch.compile``
        variants of one model would."""
        return memfit.checkpoint(
            copy.copy(self.model if model is None else model),
            policy,
            executor=self.executor,
            options=self.options if policy.offload else None,
        )

    def step(self, module: nn.Module, marks: list[float] | None = None) -> Callable[[], float]:
        """One training step of ``module`` (the model or a wrapper of it); returns the loss.

        If ``marks`` is given, ``[start, end of forward + loss]`` (``time.perf_counter``) are
        appended.
        """

        def run() -> float:
            t0 = time.perf_counter()
            loss = self.loss(module(*self.args, **self.kwargs))
            if marks is not None:
                if loss.is_cuda:
                    torch.cuda.synchronize(loss.device)
                marks.extend([t0, time.perf_counter()])
            loss.backward()
            return float(loss.detach())

        return run


@dataclass
class PolicyResult:
    """What one policy's step cost, measured."""

    policy: Policy
    peak_bytes: int
    plan: Plan
    step_times: list[float]
    compile_s: float
    timeline: list[tuple[float, int]] = field(repr=False)
    forward_end: float  # fraction of the measured step at which forward + loss ended
    measured_s: float  # duration of the memory-measured step (the timeline's time scale)
    recaptured: bool = False  # the wrapper planned again while being measured

    @property
    def label(self) -> str:
        return self.policy.label

    @property
    def step_time(self) -> float:
        return statistics.median(self.step_times) if self.step_times else float("nan")

    @property
    def predicted_peak_bytes(self) -> int:
        return self.plan.predicted_peak_bytes

    @property
    def recompute_fraction(self) -> float:
        fwd = self.plan.forward_flops
        return self.plan.recompute_flops / fwd if fwd else 0.0


def plain_peak_bytes(work: Workload, device: torch.device) -> int:
    """Plain PyTorch's measured peak of one training step (forward, loss, backward) of the model
    as written, after one warm step: what a user would have without memfit, and so what
    memfit's savings are quoted against (memfit's ``"none"`` is shown beside it; it can be
    below plain, where memfit frees what eager autograd keeps, or above it)."""
    model = work.model
    method = Method("plain", model, work.step(model), model, record_failures=False)
    first_step(method, device)
    peak = int(measure_peak(method, device).peak_bytes or 0)
    model.zero_grad(set_to_none=True)
    return peak


def run_policies(
    work: Workload,
    policies: Sequence[Policy],
    device: torch.device,
    timing_runs: int = 3,
    progress: Any = None,
) -> list[PolicyResult]:
    """Compile every policy, measure each one's memory, then time them round-robin (see above).

    ``progress`` is an optional ``rich.progress.Progress`` to report on.
    """
    task = None
    if progress is not None:
        task = progress.add_task("policies", total=len(policies) * (2 + timing_runs))

    def doing(text: str, advance: bool = False) -> None:
        if progress is not None:
            progress.update(task, description=text, advance=1 if advance else 0)

    torch.compiler.reset()
    model = work.model
    methods = []
    for policy in policies:
        doing(f"{policy.label}: capturing, planning, compiling (first step)")
        wrapped = work.wrap(policy, model)
        method = Method(policy.label, model, work.step(wrapped), wrapped, record_failures=False)
        try:
            first_step(method, device)
        except memfit.BudgetError as err:
            raise CliError(f"policy {policy.label!r}: {err}") from err
        methods.append(method)
        doing(policy.label, advance=True)
    before = Snapshot(methods)

    results = []
    for policy, method in zip(policies, methods):
        doing(f"{policy.label}: measuring the memory of one step")
        marks: list[float] = []
        m = measure_peak(method, device, step=work.step(method.module, marks))
        forward_end = (marks[1] - marks[0]) / m.time_s if m.time_s > 0 else 0.5
        results.append(
            PolicyResult(
                policy=policy,
                peak_bytes=int(m.peak_bytes or 0),
                plan=before.plans[method],
                step_times=method.times,
                compile_s=method.record["first_step_s"],
                timeline=list(m.timeline),
                forward_end=min(max(forward_end, 0.0), 1.0),
                measured_s=m.time_s,
            )
        )
        doing(policy.label, advance=True)

    def timing(method: Method, rnd: int) -> None:
        doing(f"{method.name}: timing step {rnd + 1} of {timing_runs}", advance=True)

    time_interleaved(methods, timing_runs, device, before_step=timing)
    model.zero_grad(set_to_none=True)
    for method, result in zip(methods, results):
        result.recaptured = bool(before.plan_changed(method))
    doing("policies measured")
    return results
