"""The largest batch whose training step fits a memory budget, found with real measured steps.

What the budget covers: all tensor memory of one training step on the device, that is the
parameters and buffers and the batch (live before the step), plus the peak ``memfit.measure``
records above that during forward, loss and backward (activations, gradients, scratch). Optimizer
state is not included. So a budget below the parameters can never fit, and is refused up front.

How: the batch is a multiple of ``step`` (default 1). Starting at the example batch, the batch is
doubled while it fits (halved while it does not), then bisected between the largest batch that fit
and the smallest that did not, until they are one ``step`` apart. Every probe is a real step: the
model is wrapped afresh in the policy (shapes are static, so each batch size is captured and planned
for itself), run once to compile, then run once under ``memfit.measure``. So the result ``b`` was
measured to fit and ``b + step`` was measured not to, assuming memory grows with the batch. A probe
that runs out of device memory (CUDA) counts as not fitting. Inputs of another batch size are made
from the example inputs by repeating their rows along ``batch_dim``; tensors whose size along that
dimension is not the example batch size (a mask shared by all rows, a scalar) are left alone.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import memfit
from memfit._compat import tree_flatten, tree_map
from memfit.cli.errors import CliError
from memfit.cli.steps import Workload
from memfit.execution.largest_batch import bisect_largest
from memfit.measurement.resident import resident_bytes
from memfit.planning.policy import Policy

__all__ = [
    "Probe",
    "SearchResult",
    "batch_size_of",
    "resize_batch",
    "measure_probe",
    "search_max_batch",
]


@dataclass(frozen=True)
class Probe:
    """One measured step at one batch size."""

    batch: int
    total_bytes: int | None  # resident (weights, batch) + measured peak; None if it ran out
    fits: bool
    error: str | None = None


@dataclass(frozen=True)
class SearchResult:
    """``max_batch`` fits (0: not even ``step`` does); ``first_not_fitting`` was measured not to."""

    label: str
    budget_bytes: int
    step: int
    max_batch: int
    total_bytes: int | None
    first_not_fitting: int | None
    capped: bool  # stopped at the batch limit while still fitting
    probes: tuple[Probe, ...]


def batch_size_of(args: Any, kwargs: Any, batch_dim: int) -> int:
    """Size along ``batch_dim`` of the first input tensor that has that dimension."""
    for t in tree_flatten((args, kwargs))[0]:
        if isinstance(t, torch.Tensor) and t.dim() > batch_dim:
            return int(t.shape[batch_dim])
    raise CliError(
        f"--batch-dim {batch_dim}: no example input has a dimension {batch_dim}, so "
        "the batch size cannot be changed; pass --batch-dim for your inputs' layout"
    )


def resize_batch(value: Any, batch_dim: int, old: int, new: int) -> Any:
    """``value`` with every tensor of size ``old`` along ``batch_dim`` given ``new`` rows."""
    if new == old:
        return value

    def resize(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() > batch_dim and t.shape[batch_dim] == old:
            index = torch.arange(new, device=t.device) % old
            return t.index_select(batch_dim, index).requires_grad_(t.requires_grad)
        return t

    return tree_map(resize, value)


def measure_probe(
    work: Workload,
    policy: Policy,
    device: torch.device,
    budget_bytes: int,
    batch_dim: int,
    batch: int,
) -> Probe:
    """Wrap ``work.model`` with ``policy``, compile at ``batch`` rows, measure one step's total."""
    old = batch_size_of(work.args, work.kwargs, batch_dim)
    probe_work = Workload(
        work.model,
        resize_batch(work.args, batch_dim, old, batch),
        resize_batch(work.kwargs, batch_dim, old, batch),
        work.loss,
    )
    torch.compiler.reset()
    wrapped = work.wrap(policy)
    try:
        work.model.zero_grad(set_to_none=True)
        probe_work.step(wrapped)()
        work.model.zero_grad(set_to_none=True)
        m = memfit.measure(probe_work.step(wrapped), device=device)
    except torch.OutOfMemoryError as err:
        return Probe(batch, None, False, f"out of memory: {str(err).splitlines()[0]}")
    except memfit.BudgetError as err:  # a budget policy with no plan at this batch size
        return Probe(batch, None, False, f"no plan within the policy's budget: {err}")
    finally:
        work.model.zero_grad(set_to_none=True)
        del wrapped
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    weights, inputs = resident_bytes(work.model, probe_work.args, probe_work.kwargs)
    total = weights + inputs + int(m.peak_bytes or 0)
    return Probe(batch, total, total <= budget_bytes)


def search_max_batch(
    probe: Callable[[int], Probe],
    *,
    label: str,
    budget_bytes: int,
    start: int,
    step: int = 1,
    limit: int = 65536,
    on_probe: Callable[[Probe], None] | None = None,
) -> SearchResult:
    """Largest multiple of ``step`` (up to ``limit``) for which ``probe(batch).fits``.

    Doubling from ``start`` (rounded to a multiple of ``step``), then bisection
    (``memfit.execution.largest_batch.bisect_largest``); see above.
    """
    probes: dict[int, Probe] = {}

    def fits(batch: int) -> bool:
        probes[batch] = probe(batch)
        if on_probe is not None:
            on_probe(probes[batch])
        return probes[batch].fits

    try:
        found, first_not, capped = bisect_largest(fits, start=start, multiple_of=step, limit=limit)
    except ValueError:
        raise ValueError(f"need 1 <= step <= limit, got step={step}, limit={limit}") from None
    return SearchResult(
        label=label,
        budget_bytes=budget_bytes,
        step=step,
        max_batch=found,
        total_bytes=probes[found].total_bytes if found else None,
        first_not_fitting=first_not,
        capped=capped,
        probes=tuple(probes.values()),
    )
