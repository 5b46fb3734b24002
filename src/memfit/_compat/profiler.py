"""The profiler's raw events, from which memfit counts CPU memory exactly."""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "cpu_memory_device_types",
    "profiler_allocations",
    "profiler_enabled",
    "profiler_events",
]


# ---- the profiler's raw events (checked 2.13.0) --------------------------------------------------
def profiler_enabled() -> bool:
    """Whether any torch profiler session is active on this thread (``torch._C._autograd``)."""
    return bool(torch._C._autograd._profiler_enabled())


def profiler_events(prof: torch.profiler.profile) -> list[Any]:
    """The raw events of a finished session (``prof.profiler.kineto_results.events()``).

    Unlike ``key_averages()`` they keep each allocation's signed size (``nbytes()``) and start
    time (``start_ns()``), which a peak needs.
    """
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    return list(results.events()) if results is not None else []


def cpu_memory_device_types() -> set[Any]:
    """Device types of ``[memory]`` events that are CPU allocator memory (CPU, MKLDNN, IDEEP)."""
    device_type = torch._C._autograd.DeviceType
    return {getattr(device_type, n) for n in ("CPU", "MKLDNN", "IDEEP") if hasattr(device_type, n)}


def profiler_allocations(prof: torch.profiler.profile) -> list[tuple[int, int, int]] | None:
    """``(start_ns, signed bytes, address)`` of every CPU allocator event, or None if unknown.

    ``kineto_results.experimental_event_tree()`` carries the block address, which the flat events
    do not; it costs a walk over every event (checked 2.13.0).
    """
    try:
        from torch._C._profiler import _EventType

        results = prof.profiler.kineto_results if prof.profiler is not None else None
        if results is None:
            return None
        out = []
        stack = list(results.experimental_event_tree())
        while stack:
            ev = stack.pop()
            stack.extend(ev.children)
            if ev.tag != _EventType.Allocation:
                continue
            fields: Any = ev.extra_fields  # an allocation event: typed as the union of all kinds
            if fields.device.type != "cpu" or not fields.alloc_size:
                continue
            out.append((int(ev.start_time_ns), int(fields.alloc_size), int(fields.ptr)))
        return out
    except (AttributeError, ImportError, RuntimeError):
        return None
