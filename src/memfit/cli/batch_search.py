"""The largest batch whose training step fits a memory budget, found with real measured steps.

What the budget covers: all tensor memory of one training step on the device, that is the
parameters and buffers and the batch (live before the step), plus the peak ``memfit.measure``
records above that during forward, loss and backward (activations, gradients, scratch). Optimizer
state is not included. So a budget below the parameters can never fit, and is refused up front.

How: the batch is a multiple of ``step`` (default 1). Starting at the example batch, the batch is
doubled while it fits (halved while it does not), then bisected between the largest batch that fit
and the smallest that did not, until they are one ``step`` apart. Every probe is a real step,
tried as ``memfit.largest_batch`` tries its batches (``execution.largest_batch.probe_batch``):
the model and its loss as one ``memfit.step`` under the policy (shapes are static, so each batch
size is captured and planned for itself), run once to compile, then run once under
``memfit.measure``. So the result ``b`` was measured to fit and ``b + step`` was measured not to,
assuming memory grows with the batch. A probe that runs out of device memory (CUDA), for which the
policy's budget has no plan, or whose weights and batch alone exceed the budget counts as not
fitting. Inputs of another batch size are made from the example inputs by repeating their rows
along ``batch_dim`` (``memfit.fitting.step_plan.with_size``); tensors whose size along that
dimension is not the example batch size (a mask shared by all rows, a scalar) are left alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from memfit.cli.errors import CliError
from memfit.cli.steps import Workload
from memfit.execution.largest_batch import BatchProbe, probe_batch, search_probed
from memfit.fitting.step_plan import size_of, with_size
from memfit.planning.policy import Policy

__all__ = [
    "Probe",
    "SearchResult",
    "batch_size_of",
    "measure_probe",
    "search_max_batch",
]


#: One measured step at one batch size: ``memfit.largest_batch``'s record of a probe.
Probe = BatchProbe


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
    try:
        return size_of(args, kwargs, batch_dim)
    except ValueError:
        raise CliError(
            f"--batch-dim {batch_dim}: no example input has a dimension {batch_dim}, so "
            "the batch size cannot be changed; pass --batch-dim for your inputs' layout"
        ) from None


def measure_probe(
    work: Workload,
    policy: Policy,
    device: torch.device,
    budget_bytes: int,
    batch_dim: int,
    batch: int,
) -> Probe:
    """One step of ``work`` at ``batch`` rows under ``policy``, measured (``probe_batch``)."""
    old = batch_size_of(work.args, work.kwargs, batch_dim)
    args, kwargs = with_size((work.args, work.kwargs), batch_dim, old, batch)

    def train_step(*args: Any, **kwargs: Any) -> torch.Tensor:
        return work.loss(work.model(*args, **kwargs))

    probe, _ = probe_batch(
        work.model,
        train_step,
        batch,
        tuple(args),
        dict(kwargs),
        budget_bytes,
        policy=policy,
        executor=work.executor,
        options=work.options if policy.offload else None,
        device=device,
    )
    return probe


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
    (``memfit.execution.largest_batch.search_probed``, as ``memfit.largest_batch`` searches);
    see above.
    """
    try:
        found, first_not, capped, probes = search_probed(
            probe, start=start, multiple_of=step, limit=limit, on_probe=on_probe
        )
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
