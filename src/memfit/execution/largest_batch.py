"""``memfit.largest_batch``: the largest batch whose whole training step fits a memory budget.

The question a user comes with is "in the memory I have, how large a batch can I train, and what
does each sample cost?". It is answered with real steps, measured, not with a formula:

* **What the budget covers**: every tensor of one training step on the device: the parameters and
  buffers and the batch (live before the step), plus the peak ``memfit.measure`` records above
  that during forward, loss and backward (activations, gradients, scratch, offload buffers).
  Optimizer state is not included (an optimizer's ``step()`` runs after the backward has freed
  the activations; add its state to the weights yourself if it lives on the device).
* **The step**: the model and the loss run as one ``memfit.step``, so the loss (a language
  model's logits and their cross-entropy) is inside the captured graph: planned, predicted and
  under the budget like every other value.
* **The policy**: any memfit policy, or ``"auto"``: at each batch, the budget left once the weights
  and the batch are counted becomes a byte budget with ``offload=True``, so the planner chooses per
  value between keeping, recomputing and offloading (host memory on CUDA, disk on CPU) the least
  time that fits. ``"memory"`` finds the largest batch at any cost in recomputation; ``"auto"`` the
  same or larger, and at each batch the fastest plan that fits.
* **The search** (``bisect_largest``): from ``start``, the batch doubles while it fits (halves while
  it does not), then is bisected until the largest batch that fit and the smallest that did not are
  one ``multiple_of`` apart: both were measured. A probe that runs out of device memory (CUDA) or
  for which no plan fits the budget counts as not fitting. Memory is assumed to grow with the
  batch.
* **One way to try a batch** (``probe_batch``): the step captured, planned and run once, then
  measured; ``memfit profile --budget`` tries its batches with it too.
* **Time per sample**: once found, the answer is captured again and timed over ``timing_steps``
  steps (median), without the memory profiler, which slows CPU steps.

Each probe resets Dynamo (``torch.compiler.reset()``): every batch size is a new capture of the
same step function, and Dynamo stops compiling a function after a few shapes. Run the search
before training, not between compiled steps of your own.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.execution.options import Executor, Options, PolicyLike
from memfit.execution.step import Step, step
from memfit.measurement import measure
from memfit.measurement.resident import resident_bytes
from memfit.planning.budget import BudgetError, parse_budget
from memfit.planning.plan import Plan

__all__ = [
    "BatchProbe",
    "LargestBatch",
    "bisect_largest",
    "largest_batch",
    "model_loss",
    "probe_batch",
    "search_probed",
]

#: The policy that lets the planner recompute and offload per value, the least time that fits.
AUTO = "auto"


@dataclass(frozen=True)
class BatchProbe:
    """One measured step at one batch size."""

    batch: int
    fits: bool
    #: weights and buffers + the batch + the step's measured peak; None when it did not run
    total_bytes: int | None
    #: the step's peak above what was live before it (``memfit.measure``); None when it did not run
    peak_bytes: int | None
    #: why it did not run (no plan fits, out of memory); None when it ran
    error: str | None = None


@dataclass(frozen=True)
class LargestBatch:
    """What ``memfit.largest_batch`` found: ``batch`` fits, ``batch + multiple_of`` was measured
    not to (unless ``capped``)."""

    #: the largest batch that fits (0: not even ``multiple_of`` rows do)
    batch: int
    budget_bytes: int
    policy: str
    #: the plan that ran at ``batch`` (None when nothing fits)
    plan: Plan | None
    #: the step's measured peak above what was live before it, at ``batch``
    peak_bytes: int | None
    #: weights and buffers + batch + peak, at ``batch``: what the budget bounds
    total_bytes: int | None
    #: median seconds of one step at ``batch`` divided by ``batch`` (None when nothing fits)
    seconds_per_sample: float | None
    #: the smallest batch measured not to fit (None when ``capped``)
    first_not_fitting: int | None
    #: the search stopped at ``limit`` while still fitting
    capped: bool
    probes: tuple[BatchProbe, ...]

    def __str__(self) -> str:
        if self.batch == 0:
            least = min(
                (p for p in self.probes if p.total_bytes), key=lambda p: p.batch, default=None
            )
            seen = f"; batch {least.batch} needed {least.total_bytes:,} bytes" if least else ""
            return f"no batch fits {self.budget_bytes:,} bytes under policy {self.policy!r}{seen}"
        per_sample = (
            f", {self.seconds_per_sample * 1e3:.3g} ms per sample"
            if self.seconds_per_sample is not None
            else ""
        )
        nxt = "the search limit" if self.capped else f"{self.first_not_fitting} does not"
        return (
            f"largest batch {self.batch} within {self.budget_bytes:,} bytes under policy "
            f"{self.policy!r} ({self.total_bytes:,} bytes measured{per_sample}; {nxt})"
        )


def bisect_largest(
    fits: Callable[[int], bool], *, start: int, multiple_of: int = 1, limit: int = 65536
) -> tuple[int, int | None, bool]:
    """``(largest, first_not_fitting, capped)``: the largest multiple of ``multiple_of`` up to
    ``limit`` for which ``fits`` holds, assuming it holds below some size and not above.

    From ``start`` (rounded to a multiple), doubling while ``fits``, halving while not, then
    bisection. ``largest`` is 0 when not even ``multiple_of`` fits; ``first_not_fitting`` is None
    when the search reached ``limit`` still fitting (``capped``). Each size is asked once.
    """
    if multiple_of < 1 or limit < multiple_of:
        raise ValueError(
            f"need 1 <= multiple_of <= limit, got multiple_of={multiple_of}, limit={limit}"
        )
    asked: dict[int, bool] = {}

    def ok(k: int) -> bool:  # k counts multiples: batch = k * multiple_of
        if k not in asked:
            asked[k] = fits(k * multiple_of)
        return asked[k]

    k_max = limit // multiple_of
    k = min(max(1, round(start / multiple_of)), k_max)
    lo: int
    hi: int | None
    capped = False
    if ok(k):
        lo, hi = k, None
        while hi is None:
            if lo == k_max:
                capped = True
                break
            nxt = min(2 * lo, k_max)
            if ok(nxt):
                lo = nxt
            else:
                hi = nxt
    else:
        lo, hi = 0, k
        while hi > 1:
            nxt = hi // 2
            if ok(nxt):
                lo = nxt
                break
            hi = nxt
    if hi is not None and lo > 0:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if ok(mid):
                lo = mid
            else:
                hi = mid
    return lo * multiple_of, (hi * multiple_of if hi is not None else None), capped


def search_probed(
    probe: Callable[[int], BatchProbe],
    *,
    start: int,
    multiple_of: int = 1,
    limit: int = 65536,
    on_probe: Callable[[BatchProbe], None] | None = None,
) -> tuple[int, int | None, bool, dict[int, BatchProbe]]:
    """``bisect_largest`` over ``probe(n).fits``: ``(largest, first_not_fitting, capped,
    probes)``, every probe made by batch in the order made, each handed to ``on_probe`` as it
    is made (``memfit.largest_batch`` and ``memfit profile --budget`` search alike)."""
    probes: dict[int, BatchProbe] = {}

    def fits(n: int) -> bool:
        probes[n] = probe(n)
        if on_probe is not None:
            on_probe(probes[n])
        return probes[n].fits

    found, first_not, capped = bisect_largest(
        fits, start=start, multiple_of=multiple_of, limit=limit
    )
    return found, first_not, capped, probes


def _call_args(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A batch as a call's arguments: a tuple is positional, a mapping is keywords."""
    if isinstance(batch, tuple):
        return batch, {}
    if isinstance(batch, Mapping):
        return (), dict(batch)
    return (batch,), {}


def model_loss(output: Any) -> torch.Tensor | None:
    """The model's own loss in its output: a scalar output, or a scalar ``loss`` attribute or
    key (HF models given labels); None where it has none. ``memfit profile``'s step reads it too
    (``cli.steps.default_loss``)."""
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.dim() == 0 else None


def _loss_of(output: Any) -> torch.Tensor:
    """The model's own loss (``model_loss``), or why a step cannot be made without ``loss=``."""
    loss = model_loss(output)
    if loss is not None:
        return loss
    raise ValueError(
        f"memfit.largest_batch: the model returned {type(output).__name__}, not a scalar loss "
        "or an output with a scalar .loss; pass loss=fn(output, target) (make_batch then returns "
        "(inputs, target)) or step=fn(*batch) returning the loss"
    )


def _step_function(
    model: nn.Module,
    loss: Callable[[Any, Any], torch.Tensor] | None,
    step_fn: Callable[..., torch.Tensor] | None,
) -> Callable[..., torch.Tensor]:
    """One function from a batch to the loss: what ``memfit.step`` captures and plans."""
    if step_fn is not None:
        return step_fn
    if loss is not None:

        def model_and_loss(inputs: Any, target: Any) -> torch.Tensor:
            args, kwargs = _call_args(inputs)
            return loss(model(*args, **kwargs), target)

        return model_and_loss

    def model_with_its_loss(*args: Any, **kwargs: Any) -> torch.Tensor:
        return _loss_of(model(*args, **kwargs))

    return model_with_its_loss


def _device_of(model: nn.Module) -> torch.device:
    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.device("cpu")


@dataclass
class _Search:
    """What every probe of one search shares."""

    model: nn.Module
    make_batch: Callable[[int], Any]
    function: Callable[..., torch.Tensor]
    budget: int
    policy: PolicyLike
    offload: bool
    executor: Executor | str
    options: Options | None
    uses_target: bool  # loss= given: a batch is (inputs, target)

    def batch_args(self, n: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call's arguments for ``n`` rows."""
        batch = self.make_batch(n)
        if self.uses_target:
            if not (isinstance(batch, tuple) and len(batch) == 2):
                raise TypeError(
                    f"memfit.largest_batch: with loss=, make_batch(n) returns (inputs, target); "
                    f"make_batch({n}) returned {type(batch).__name__}"
                )
            args: tuple[Any, ...] = batch
            kwargs: dict[str, Any] = {}
        else:
            args, kwargs = _call_args(batch)
        return args, kwargs

    def run(self, n: int) -> tuple[BatchProbe, Step | None, Any]:
        """``probe_batch`` at ``n`` rows of ``make_batch``; the call's arguments with it."""
        args, kwargs = self.batch_args(n)
        probe, stepper = probe_batch(
            self.model,
            self.function,
            n,
            args,
            kwargs,
            self.budget,
            policy=self.policy,
            offload=self.offload,
            executor=self.executor,
            options=self.options,
        )
        return probe, stepper, (args, kwargs)


def _stepper(
    function: Callable[..., torch.Tensor],
    room: int,
    policy: PolicyLike,
    offload: bool,
    executor: Executor | str,
    options: Options | None,
) -> Step:
    """``memfit.step`` of ``function`` under ``policy``; ``"auto"``: ``room`` bytes, offloading."""
    if policy == AUTO:
        return step(function, policy=room, offload=True, executor=executor, options=options)
    return step(function, policy=policy, offload=offload, executor=executor, options=options)


def probe_batch(
    model: nn.Module,
    function: Callable[..., torch.Tensor],
    batch: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    budget: int,
    *,
    policy: PolicyLike = AUTO,
    offload: bool = False,
    executor: Executor | str = Executor.EAGER,
    options: Options | None = None,
    device: torch.device | None = None,
) -> tuple[BatchProbe, Step | None]:
    """Try one batch of ``batch`` rows: ``function(*args, **kwargs)`` (``model``'s step, returning
    the loss) as a ``memfit.step`` under ``policy``, captured, planned and run once, then run
    again under ``memfit.measure`` on ``device`` (default: where ``model``'s parameters are).
    Returns the probe (weights + batch + measured peak against ``budget``) and the step that ran
    (None when it did not: the weights and batch alone exceed the budget, no plan fits, out of
    memory).

    The one way memfit tries a batch: ``memfit.largest_batch`` and ``memfit profile --budget``
    both probe with it. Dynamo is reset first, and ``model``'s ``.grad`` set to None around it.
    """
    weights, batch_bytes = resident_bytes(model, args, kwargs)
    room = budget - weights - batch_bytes
    if room <= 0:
        why = f"weights and batch alone take {weights + batch_bytes:,} bytes"
        return BatchProbe(batch, False, None, None, why), None
    torch.compiler.reset()
    stepper = _stepper(function, room, policy, offload, executor, options)
    device = device or _device_of(model)
    try:
        model.zero_grad(set_to_none=True)
        stepper(*args, **kwargs).backward()
        model.zero_grad(set_to_none=True)
        m = measure(lambda: stepper(*args, **kwargs).backward(), device=device)
    except torch.OutOfMemoryError as err:
        first = str(err).splitlines()[0] if str(err) else "out of memory"
        return BatchProbe(batch, False, None, None, f"out of memory: {first}"), None
    except BudgetError as err:
        why = (
            f"no plan fits: {err.least_bytes:,} bytes at least, {room:,} left"
            if policy == AUTO
            else f"no plan within the policy's budget: {err}"
        )
        return BatchProbe(batch, False, None, None, why), None
    finally:
        model.zero_grad(set_to_none=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    total = weights + batch_bytes + int(m.peak_bytes or 0)
    return BatchProbe(batch, total <= budget, total, m.peak_bytes), stepper


def _seconds_per_step(stepper: Step, model: nn.Module, call: Any, steps: int) -> float:
    args, kwargs = call
    device = _device_of(model)
    times = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        stepper(*args, **kwargs).backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    return statistics.median(times)


def _checked_budget(
    model: nn.Module,
    budget: int | str,
    loss: Callable[..., Any] | None,
    step_fn: Callable[..., Any] | None,
    timing_steps: int,
) -> int:
    """The budget in bytes, once the arguments are known to make a search that can succeed."""
    parsed = parse_budget(budget)
    if parsed.bytes is None:
        raise ValueError(
            f"memfit.largest_batch: the budget is device memory in bytes (an int or a size such "
            f"as '16GiB'), got the fraction {budget!r}"
        )
    budget_bytes = parsed.bytes
    if loss is not None and step_fn is not None:
        raise TypeError("memfit.largest_batch: give loss= or step_fn=, not both")
    if timing_steps < 1:
        raise ValueError(f"memfit.largest_batch: timing_steps must be >= 1, got {timing_steps}")
    weights, _ = resident_bytes(model)
    if weights >= budget_bytes:
        raise ValueError(
            f"memfit.largest_batch: the model's parameters and buffers take {weights:,} bytes, "
            f"over the budget of {budget_bytes:,}: no batch can fit; raise the budget or shrink "
            "the model (a smaller dtype, or memfit.pipeline over several devices)"
        )
    return budget_bytes


def largest_batch(
    model: nn.Module,
    make_batch: Callable[[int], Any],
    budget: int | str,
    *,
    loss: Callable[[Any, Any], torch.Tensor] | None = None,
    step_fn: Callable[..., torch.Tensor] | None = None,
    policy: PolicyLike = AUTO,
    offload: bool = False,
    executor: Executor | str = Executor.EAGER,
    options: Options | None = None,
    start: int = 1,
    multiple_of: int = 1,
    limit: int = 65536,
    timing_steps: int = 3,
    on_probe: Callable[[BatchProbe], None] | None = None,
) -> LargestBatch:
    """The largest batch whose training step, weights and batch included, fits ``budget`` bytes.

    ``make_batch(n)`` returns a batch of ``n`` rows, in one of three forms:

    * with ``step_fn=fn``: ``fn``'s arguments (a tuple, a mapping of keywords, or one value);
      ``fn(*batch)`` returns the loss, as a function given to ``memfit.step``;
    * with ``loss=fn``: ``(inputs, target)``, the model called on ``inputs`` (a tuple, a mapping,
      or one tensor) and ``fn(output, target)`` the loss;
    * with neither: the model's inputs, and the model returns its own loss (a scalar, or an output
      with a scalar ``.loss``: HF models given labels).

    ``policy`` is any memfit policy, or ``"auto"`` (the default): the budget left after the weights
    and the batch, as a byte budget with ``offload=True`` (the least time that fits). The model's
    ``.grad`` is set to None before each step, as ``optimizer.zero_grad()`` leaves it, and after
    the search. Returns a ``LargestBatch``: the batch, its plan, its measured peak and time per
    sample, and every probe. Raises ``ValueError`` when the weights alone exceed the budget.
    """
    budget_bytes = _checked_budget(model, budget, loss, step_fn, timing_steps)
    search = _Search(
        model,
        make_batch,
        _step_function(model, loss, step_fn),
        budget_bytes,
        policy,
        offload,
        executor,
        options,
        uses_target=loss is not None,
    )
    found, first_not, capped, probes = search_probed(
        lambda n: search.run(n)[0],
        start=start,
        multiple_of=multiple_of,
        limit=limit,
        on_probe=on_probe,
    )
    label = policy if isinstance(policy, str) else str(policy)
    seen = tuple(probes.values())
    if found == 0:
        return LargestBatch(0, budget_bytes, label, None, None, None, None, first_not, capped, seen)
    # The answer again, captured afresh (later probes reset Dynamo), measured and timed.
    final, stepper, call = search.run(found)
    assert stepper is not None
    per_sample = _seconds_per_step(stepper, model, call, timing_steps) / found
    return LargestBatch(
        found,
        budget_bytes,
        label,
        stepper.plan,
        final.peak_bytes,
        final.total_bytes,
        per_sample,
        first_not,
        capped,
        seen,
    )
