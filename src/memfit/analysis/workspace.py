"""Scratch memory of each op, measured by running it once on inputs of the right shape.

Why measure: an op may allocate far more than its outputs while it runs. On CPU, oneDNN's
convolution allocates a second output-sized buffer in forward, its backward about twice its
input, a transposed convolution three times its output; on CUDA, cuDNN picks workspaces at run
time. A simulator that counted outputs alone mispredicted a U-Net's peak by 40%, and a planner
that cannot see scratch memory happily recomputes a convolution at the very moment of the peak.
No table of op costs stays true across libraries and devices, so memfit measures.

Each distinct signature (op, shapes, strides, dtypes, constant arguments) runs once, on fresh
tensors filled from a private generator (floats random, integers zero: valid indices for pooling
and embedding backward). Random ops are never run, so the user's RNG stream is untouched. Ops
whose tensors are all small are skipped: their scratch cannot move a peak.
"""

from __future__ import annotations

import bisect
import operator
from typing import Any, Iterable

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils._python_dispatch import _disable_current_modes

from memfit.analysis.graph import is_random, node_tensors

__all__ = ["measure_workspace"]


def _signature(node: fx.Node) -> Any:
    def key(a: Any) -> Any:
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):
                return ("T", tuple(v.shape), tuple(v.stride()), v.dtype, v.device.type)
            return ("N", repr(v))
        return repr(a)

    flat, _ = tree_flatten((node.args, node.kwargs))
    return (str(node.target), tuple(key(a) for a in flat))


def _materialize(val: torch.Tensor, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """A real tensor with ``val``'s shape, strides (overlapping ones too) and dtype."""
    span = 1 + sum((size - 1) * stride for size, stride in zip(val.shape, val.stride()))
    span = max(span, 0) if val.numel() else 0
    if val.dtype.is_floating_point or val.dtype.is_complex:
        base = torch.randn(span, generator=gen, dtype=val.dtype).to(device)
    else:
        base = torch.zeros(span, dtype=val.dtype, device=device)
    return base.as_strided(tuple(val.shape), tuple(val.stride()))


def _runnable(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target is operator.getitem or is_random(node):
        return False
    if not isinstance(node.target, torch._ops.OpOverload):
        return False
    schema = node.target._schema
    if schema.is_mutable or any(r.alias_info is not None for r in schema.returns):
        return False  # in-place ops and views allocate nothing of their own
    return all(
        isinstance(a.meta.get("val"), torch.Tensor)
        for a in node.all_input_nodes
    )


def _nbytes(vals: Iterable[torch.Tensor]) -> int:
    return sum(t.untyped_storage().nbytes() for t in vals)


def measure_workspace(
    nodes: Iterable[fx.Node], *, min_bytes: int = 0, device: torch.device | None = None
) -> dict[fx.Node, int]:
    """Bytes each node allocates while running beyond its outputs (0 entries omitted)."""
    candidates: dict[Any, list[fx.Node]] = {}
    for n in nodes:
        if not _runnable(n):
            continue
        touched = node_tensors(n) + [t for a in n.all_input_nodes for t in node_tensors(a)]
        if not touched or max(t.numel() * t.element_size() for t in touched) < min_bytes:
            continue
        candidates.setdefault(_signature(n), []).append(n)
    if not candidates:
        return {}
    first = next(iter(candidates.values()))[0]
    dev = device or node_tensors(first)[0].device
    # The partitioner runs inside AOTAutograd's tracing, under its fake-tensor mode: leave every
    # dispatch mode so that these ops run on real memory.
    with _disable_current_modes(), torch.no_grad():
        scratch = _measure_signatures(candidates, dev)
    out: dict[fx.Node, int] = {}
    for sig, group in candidates.items():
        if scratch.get(sig, 0) > 0:
            for n in group:
                out[n] = scratch[sig]
    return out


def _measure_signatures(candidates: dict[Any, list[fx.Node]], dev: torch.device) -> dict[Any, int]:
    gen = torch.Generator().manual_seed(0)
    runs = []
    for sig, group in candidates.items():
        node = group[0]

        def real(a: Any) -> Any:
            if isinstance(a, fx.Node):
                return _materialize(a.meta["val"], dev, gen)
            return a

        try:
            args = tree_map(real, node.args)
            kwargs = tree_map(real, dict(node.kwargs))
        except (RuntimeError, TypeError, ValueError):
            continue  # not materializable (exotic dtype or layout): counted as no scratch
        runs.append((sig, node.target, args, kwargs))
    return _run_cuda(runs, dev) if dev.type == "cuda" else _run_cpu(runs)


def _outputs(result: Any) -> list[torch.Tensor]:
    flat, _ = tree_flatten(result)
    return [t for t in flat if isinstance(t, torch.Tensor)]


def _run_cuda(runs: list[Any], dev: torch.device) -> dict[Any, int]:
    scratch: dict[Any, int] = {}
    for sig, target, args, kwargs in runs:
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        try:
            result = target(*args, **kwargs)
        except Exception:
            continue
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
        scratch[sig] = max(0, peak - _nbytes(_outputs(result)))
        del result
    return scratch


def _run_cpu(runs: list[Any]) -> dict[Any, int]:
    """One profiler session; each op inside a labelled range, its memory events read back."""
    from torch.profiler import ProfilerActivity, profile, record_function

    labels: dict[str, Any] = {}
    out_bytes: dict[Any, int] = {}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for i, (sig, target, args, kwargs) in enumerate(runs):
            label = f"memfit_workspace_{i}"
            try:
                with record_function(label):
                    result = target(*args, **kwargs)
            except Exception:
                continue
            labels[label] = sig
            out_bytes[sig] = _nbytes(_outputs(result))
            del result
    events = list(prof.profiler.kineto_results.events())
    ranges = [
        (e.start_ns(), e.start_ns() + e.duration_ns(), labels[e.name()])
        for e in events if e.name() in labels
    ]
    memory = sorted(
        (e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"
    )
    scratch: dict[Any, int] = {}
    for start, end, sig in ranges:
        live = peak = 0
        for t, nbytes in memory[bisect.bisect_left(memory, (start, -(2**62))):]:
            if t > end:
                break
            live += nbytes
            peak = max(peak, live)
        scratch[sig] = max(0, peak - out_bytes[sig])
    return scratch
