"""``memfit.fit``: will a training step fit on a device, under each policy, and up to what batch.

What the peak counts (``StepPeak``): the weights and buffers, the batch, the optimizer state
(held from the first ``optimizer.step()`` on, so through every later forward and backward), and
the larger of two moments as torch sequences a step with ``zero_grad(set_to_none=True)``:

- forward and backward: the plan's ``predicted_peak_bytes``, which counts what the step
  allocates above what was live before it, the parameters' gradients included as they are made
  (``planning.plan.Plan``), and not the weights or the batch;
- ``optimizer.step()``: the gradients, all alive, and the step's temporaries
  (``analysis.step_memory``); activations are gone by then.

So ``peak = weights + batch + optimizer state + max(plan peak, gradients + optimizer
temporaries)``, for the ``max_memory_allocated`` counter: weights, gradients and state are
rounded tensor by tensor as the device's allocator rounds them; the plan's activations are not
(under 512 B a tensor). A step fits when that peak is within ``Device.usable_bytes`` (capacity
less the CUDA context); the allocator cache's slack (reserved minus allocated) is not counted.
The ``activations`` reported are the plan's peak less the gradients.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memfit._compat import tree_map
from memfit.analysis.devices import Device, get_device
from memfit.analysis.step_memory import StepMemory, step_memory
from memfit.execution.fake_target import is_meta
from memfit.fitting.size_search import largest_fitting
from memfit.fitting.step_plan import plan_step, size_of, with_size
from memfit.fitting.step_time import compute_dtype_name, estimate_step_seconds
from memfit.measurement.resident import input_bytes
from memfit.planning.budget import BudgetError
from memfit.planning.plan import Plan
from memfit.planning.policy import Policy, parse_policy
from memfit.units import format_bytes

__all__ = ["StepPeak", "FitRow", "FitReport", "fit", "DEFAULT_POLICIES"]

#: The policies ``memfit.fit`` compares unless told.
DEFAULT_POLICIES = ("none", "speed", "memory")


@dataclass(frozen=True)
class StepPeak:
    """The predicted ``max_memory_allocated`` of one whole training step (module docstring)."""

    memory: StepMemory
    input_bytes: int
    #: the activations' plan: ``predicted_peak_bytes`` of forward and backward, gradients in
    plan_peak_bytes: int

    @property
    def activation_bytes(self) -> int:
        """The plan's peak above the gradients it counts."""
        return max(0, self.plan_peak_bytes - self.memory.gradient_bytes)

    @property
    def held_bytes(self) -> int:
        """Alive through the whole step: weights, the batch, the optimizer state."""
        m = self.memory
        return m.weights_bytes + self.input_bytes + m.optimizer_state_bytes

    @property
    def forward_backward_bytes(self) -> int:
        """The peak of forward and backward: what is held, and the plan's peak."""
        return self.held_bytes + self.plan_peak_bytes

    @property
    def peak_bytes(self) -> int:
        return self.held_bytes + max(self.plan_peak_bytes, self.memory.optimizer_step_bytes)


@dataclass(frozen=True)
class FitRow:
    """One policy at the asked size: where the bytes go, whether it fits, how far it goes."""

    policy: str
    batch: int
    seq: int | None
    weights_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    optimizer_temp_bytes: int
    activation_bytes: int
    input_bytes: int
    peak_bytes: int
    fits: bool
    #: the largest batch whose plan fits (0: not even 1); None: not searched
    largest_batch: int | None
    #: the largest sequence length at ``batch`` whose plan fits; None: not searched
    largest_seq: int | None
    #: False where the search stopped before planning the size after its answer
    exact: bool
    #: roofline estimate of one step at ``batch`` (``fitting.step_time``); None: no figure
    step_seconds: float | None
    #: plans made for this row (the asked size and the searches)
    plans: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "batch": self.batch,
            "seq": self.seq,
            "peak_bytes": self.peak_bytes,
            "fits": self.fits,
            "largest_batch": self.largest_batch,
            "largest_seq": self.largest_seq,
            "step_seconds": self.step_seconds,
            "weights_bytes": self.weights_bytes,
            "gradient_bytes": self.gradient_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "optimizer_temp_bytes": self.optimizer_temp_bytes,
            "activation_bytes": self.activation_bytes,
            "input_bytes": self.input_bytes,
            "exact": self.exact,
        }


@dataclass(frozen=True)
class FitReport:
    """``memfit.fit``'s answer: one row per policy, for one device."""

    device: Device
    rows: tuple[FitRow, ...]
    optimizer: str
    implementation: str
    #: where the activations were planned: ``"cuda (meta)"`` or the real model's device
    planned_on: str

    @property
    def usable_bytes(self) -> int:
        return self.device.usable_bytes

    @property
    def fits(self) -> bool:
        """Whether the asked size fits under at least one policy."""
        return any(r.fits for r in self.rows)

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device.name,
            "capacity_bytes": self.device.capacity_bytes,
            "usable_bytes": self.usable_bytes,
            "optimizer": self.optimizer,
            "implementation": self.implementation,
            "planned_on": self.planned_on,
            "rows": [r.to_dict() for r in self.rows],
        }

    def no_fit_message(self) -> str | None:
        """None where some policy fits; else what would: the largest batches, or what the
        weights, gradients and optimizer state alone take."""
        if self.fits or not self.rows:
            return None
        best = min(self.rows, key=lambda r: r.peak_bytes)
        head = (
            f"batch {best.batch} fits under no policy on {self.device.name} "
            f"({format_bytes(self.usable_bytes)} for tensors); the least peak, "
            f"{best.policy!r}, needs {format_bytes(best.peak_bytes)}"
        )
        fitting = [r for r in self.rows if r.largest_batch]
        if fitting:
            listed = ", ".join(f"{r.policy!r} batch {r.largest_batch}" for r in fitting)
            return f"{head}; what fits: {listed}"
        if all(r.largest_batch is None for r in self.rows):
            return (
                f"{head}; search for the largest batch that fits (memfit.fit's search=True, "
                f"the default; memfit fit without --no-search)"
            )
        r = best
        fixed = r.weights_bytes + r.gradient_bytes + r.optimizer_bytes + r.optimizer_temp_bytes
        return (
            f"{head}; not even batch 1 fits: weights {format_bytes(r.weights_bytes)}, "
            f"gradients {format_bytes(r.gradient_bytes)} and {self.optimizer} state and "
            f"temporaries {format_bytes(r.optimizer_bytes + r.optimizer_temp_bytes)} alone take "
            f"{format_bytes(fixed)}: try a device with more memory, bfloat16 weights, an "
            f"optimizer with less state (sgd), or pipeline stages over several devices "
            f"(memfit pipeline)"
        )


def _param_dtype(model: nn.Module) -> torch.dtype:
    return next(
        (p.dtype for p in model.parameters() if p.is_floating_point()), torch.get_default_dtype()
    )


def fit(
    model: nn.Module,
    *inputs: Any,
    device: str | Device = "h100-80gb",
    policies: Iterable[Any] = DEFAULT_POLICIES,
    optimizer: str = "adamw",
    implementation: str | None = None,
    autocast: torch.dtype | None = None,
    batch_dim: int = 0,
    seq_dim: int | None = None,
    search: bool = True,
    limit: int = 1 << 16,
    seq_limit: int | None = None,
    on_plan: Callable[[str, int, int | None, int], None] | None = None,
    **kwargs: Any,
) -> FitReport:
    """Whether one training step of ``model`` on these inputs fits on ``device``, per policy.

    The inputs are one step's batch, of the size asked about (their size along ``batch_dim``).
    For each policy the step is planned (``memfit.plan``: on a model built under
    ``torch.device("meta")``, for the device's type without allocating; on a real model where it
    lives, running one forward) and its whole peak predicted (``StepPeak``); with ``search``, the
    largest batch (and, with ``seq_dim``, the largest sequence length at this batch) whose peak
    fits, in a few plans whatever the answer (``fitting.size_search``), up to ``limit`` (the
    sequence up to ``seq_limit`` if given: a model's longest position). Each row has a roofline
    step time at the asked size, an estimate.

    ``optimizer``: ``"sgd"`` (momentum), ``"adam"``, ``"adamw"`` or ``"none"``;
    ``implementation``: ``"foreach"`` (torch's default on CUDA), ``"fused"`` or ``"for-loop"``.
    ``autocast``: the compute dtype under ``torch.autocast`` (weights stay in theirs; for pure
    bf16 put the model in bf16 instead). ``on_plan(policy, batch, seq, peak)`` is called after
    each new plan (progress). Raises ``ValueError`` for an unknown device or an optimizer not
    modelled.
    """
    target = get_device(device)
    wanted = [parse_policy(p) for p in policies]
    if not wanted:
        raise ValueError("fit needs at least one policy, e.g. policies=('none', 'memory')")
    round_bytes = target.allocated_bytes if target.type == "cuda" else None
    memory = step_memory(
        model,
        optimizer,
        implementation=implementation,
        device_type=target.type,
        round_bytes=round_bytes,
    )
    meta = is_meta(model, (inputs, kwargs))
    batch = size_of(inputs, kwargs, batch_dim)
    steps = _Steps(
        model,
        inputs,
        kwargs,
        memory,
        target.type,
        autocast,
        batch_dim,
        seq_dim,
        batch,
        size_of(inputs, kwargs, seq_dim) if seq_dim is not None else None,
        on_plan,
        shapes=_as_meta((inputs, kwargs)),
    )
    compute = compute_dtype_name(_param_dtype(model), autocast)
    rows = [
        _row(
            steps, policy, target, compute, search, limit if seq_limit is None else seq_limit, limit
        )
        for policy in wanted
    ]
    where = f"{target.type} (meta)" if meta else _where(model)
    return FitReport(target, tuple(rows), memory.optimizer, memory.implementation, where)


@dataclass
class _Steps:
    """One step's inputs resized along the batch and sequence dimensions, and each size's plan
    under each policy, made once (``plans``) however often the search asks for it."""

    model: nn.Module
    inputs: tuple[Any, ...]
    kwargs: dict[str, Any]
    memory: StepMemory
    device_type: str
    autocast: torch.dtype | None
    batch_dim: int
    seq_dim: int | None
    #: the sizes the inputs were given at
    batch: int
    seq: int | None
    on_plan: Callable[[str, int, int | None, int], None] | None
    #: the inputs as meta tensors, for the optimizer's moment (no plan needed)
    shapes: Any
    plans: dict[tuple[str, int, int], Plan] = field(default_factory=dict)

    def sized(self, value: Any, b: int, s: int | None) -> Any:
        value = with_size(value, self.batch_dim, self.batch, b)
        if self.seq_dim is not None and self.seq is not None and s is not None:
            value = with_size(value, self.seq_dim, self.seq, s)
        return value

    def planned(self, policy: Policy, b: int, s: int | None) -> StepPeak:
        """The step's peak at batch ``b`` and sequence ``s`` under ``policy``."""
        args, kw = self.sized((self.inputs, self.kwargs), b, s)
        key = (policy.label, b, s or 0)
        made = len(self.plans)
        if key not in self.plans:
            self.plans[key] = plan_step(
                self.model, args, kw, policy, self.device_type, self.autocast
            )
        step = StepPeak(self.memory, input_bytes(args, kw), self.plans[key].predicted_peak_bytes)
        if self.on_plan is not None and len(self.plans) > made:
            self.on_plan(policy.label, b, s, step.peak_bytes)
        return step

    def optimizer_moment(self, b: int, s: int | None) -> int:
        """The peak while ``optimizer.step()`` runs at this size: no plan needed."""
        args, kw = self.sized(self.shapes, b, s)
        return StepPeak(self.memory, input_bytes(args, kw), 0).peak_bytes


def _row(
    steps: _Steps,
    policy: Policy,
    target: Device,
    compute: str,
    search: bool,
    seq_limit: int,
    limit: int,
) -> FitRow:
    """``policy``'s row: its peak at the asked size, with ``search`` the largest batch (and
    sequence) that fits, and its roofline step time."""
    batch, seq, memory = steps.batch, steps.seq, steps.memory
    before = len(steps.plans)
    peak = steps.planned(policy, batch, seq)
    p = steps.plans[(policy.label, batch, seq or 0)]
    largest_batch = largest_seq = None
    exact = True
    if search:
        largest_batch, exact = _largest(
            functools.partial(steps.planned, policy, s=seq),
            functools.partial(steps.optimizer_moment, s=seq),
            target.usable_bytes,
            batch,
            limit,
        )
        if steps.seq_dim is not None and seq is not None:
            largest_seq, seq_exact = _largest(
                functools.partial(steps.planned, policy, batch),
                functools.partial(steps.optimizer_moment, batch),
                target.usable_bytes,
                seq,
                seq_limit,
            )
            exact = exact and seq_exact
    try:
        seconds: float | None = estimate_step_seconds(p, memory, target, compute)
    except ValueError:
        seconds = None
    return FitRow(
        policy=policy.label,
        batch=batch,
        seq=seq,
        weights_bytes=memory.weights_bytes,
        gradient_bytes=memory.gradient_bytes,
        optimizer_bytes=memory.optimizer_state_bytes,
        optimizer_temp_bytes=memory.optimizer_temp_bytes,
        activation_bytes=peak.activation_bytes,
        input_bytes=peak.input_bytes,
        peak_bytes=peak.peak_bytes,
        fits=peak.peak_bytes <= target.usable_bytes,
        largest_batch=largest_batch,
        largest_seq=largest_seq,
        exact=exact,
        step_seconds=seconds,
        plans=len(steps.plans) - before,
    )


def _largest(
    plan_at: Callable[[int], StepPeak],
    optimizer_at: Callable[[int], int],
    usable: int,
    start: int,
    limit: int,
) -> tuple[int, bool]:
    """The largest size whose step fits, and whether the size after it was checked.

    The two moments apart (``StepPeak``): the optimizer's is found without planning and bounds
    the search of the forward and backward's, whose peak (held bytes, the batch, the plan) is
    close to affine in the size where the maximum of the two is not. A budget policy with no
    plan at a size counts as not fitting.
    """
    bound = largest_fitting(optimizer_at, usable, start=start, limit=limit, max_plans=64)
    if bound.size == 0:
        return 0, True

    def forward_backward(size: int) -> int:
        try:
            return plan_at(size).forward_backward_bytes
        except BudgetError:
            return usable + 1

    found = largest_fitting(
        forward_backward, usable, start=min(start, bound.size), limit=bound.size
    )
    return found.size, found.exact


def _as_meta(value: Any) -> Any:
    """Tensors in ``value`` as meta tensors of the same shapes: sizes without storage."""
    return tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, value)


def _where(model: nn.Module) -> str:
    return next((p.device.type for p in model.parameters()), "cpu")
