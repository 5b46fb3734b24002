"""Measure the tensor memory and wall time of one call: ``memfit.measure``.

memfit's rule is that memory is *measured, never guessed*. :func:`measure` runs a callable exactly
once and reports how much tensor memory it needed above what was already live when it started.
This module resolves the device, finds the tensors the call can reach and dispatches to one
accounting per device: :mod:`memfit.measurement.cpu` (exact, from the profiler's allocator events)
and :mod:`memfit.measurement.cuda` (exact, from the caching allocator's counters). Their module
docstrings say how the numbers are obtained and where they stop being exact.

On CUDA, measurements nest: a ``measure`` inside a measured call reports its own part, and the
enclosing one still sees everything. On CPU, memory comes from a profiler session, only one can be
active, and one cannot safely be paused for another (see the NOTE in ``cpu.py``), so a CPU
``measure`` refuses to run inside any other profiler session, an enclosing CPU ``measure``
included; ``profile_memory=False`` (time only) works anywhere. memfit's own measurement of op
scratch memory, which runs inside a model's first call, steps aside to another process when a
session is active (``memfit.analysis.op_scratch``), so ``measure`` around a first call sees that
call's real peak.

What counts as "reachable" (for device inference and pre-existing storages)
    Tensors among ``args``/``kwargs`` and, recursively, inside lists, tuples, sets, dicts,
    ``nn.Module`` parameters, buffers and their ``.grad``, optimizer state, ``functools.partial``
    objects, bound methods, plain objects' attributes, and ``fn`` itself: its closure cells,
    defaults and the globals its code names. The search is capped at 100,000 objects. On CPU the
    frees of these tensors' storages are seen even though they were allocated before the call.

Caveats
    * Warm-up is included: a first call that initialises lazy modules, cuBLAS workspaces or caches,
      or that captures and plans a ``memfit.checkpoint`` model, pays for them. Measure a second
      call if you want the steady state.
    * ``gc.collect()`` runs before the measurement so that garbage from earlier code is not freed
      during the call (which would make the numbers too low). It costs roughly 0.1-0.3 s in a
      process that has imported torch.
    * On CPU with memory profiling on, ``time_s`` includes the profiler's per-operator overhead;
      ``measure(fn, profile_memory=False)`` measures time only.
"""

from __future__ import annotations

import functools
import gc
import time
import types
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from memfit.measurement.cpu import CpuRecording, cpu_recording_blocked
from memfit.measurement.cuda import CudaRecording
from memfit.measurement.window import MemoryWindow
from memfit.units import format_bytes

__all__ = ["Measurement", "measure"]

T = TypeVar("T")

_MAX_VISITED_OBJECTS = 100_000


@dataclass(frozen=True)
class Measurement(Generic[T]):
    """What one call of ``fn`` cost.  Produced by :func:`measure`.

    Attributes:
        peak_bytes: highest tensor memory live during the call *above what was live
            at entry*, never below 0.  ``None`` when memory was not measured
            (``profile_memory=False``).
        end_bytes: tensor bytes still allocated at exit minus those at entry; negative
            when the call freed more than it kept.  ``None`` when not measured.
        time_s: wall time of the call in seconds (``time.perf_counter``; on CUDA the
            device is synchronised before and after).  On CPU with memory profiling
            on this includes the profiler's per-operator overhead.
        device: the measured device, ``"cpu"`` or ``"cuda:N"``.
        result: whatever ``fn`` returned.
        timeline: ``(seconds since the call started, live bytes above entry)`` after
            each allocation or free, starting with ``(0.0, 0)``.  On CUDA only the
            two end points.  Empty when memory was not measured.
    """

    peak_bytes: int | None
    end_bytes: int | None
    time_s: float
    device: str
    result: T = field(repr=False, compare=False)
    timeline: list[tuple[float, int]] = field(default_factory=list, repr=False, compare=False)

    def __str__(self) -> str:
        where = f"{_format_seconds(self.time_s)} on {self.device}"
        if self.peak_bytes is None:
            return f"{where} (memory not measured)"
        end = format_bytes(self.end_bytes or 0, sign=True)
        return f"peak {format_bytes(self.peak_bytes)}, end {end}, {where}"


def measure(
    fn: Callable[..., T],
    /,
    *args: Any,
    device: str | torch.device | None = None,
    profile_memory: bool = True,
    **kwargs: Any,
) -> Measurement[T]:
    """Run ``fn(*args, **kwargs)`` once and measure its tensor memory and wall time.

    Args:
        fn: the callable to run; called exactly once.
        *args, **kwargs: passed to ``fn``.  ``device`` and ``profile_memory`` are
            taken by ``measure`` itself; to pass them to ``fn``, wrap it
            (``measure(lambda: fn(device="cpu"))``).
        device: which device's memory to measure: ``"cpu"``, ``"cuda"`` (the current
            CUDA device), ``"cuda:N"`` or a ``torch.device`` of those types.  If
            ``None``, it is ``"cuda:N"`` when a tensor reachable from ``fn`` or its
            arguments lives on CUDA (the first one found gives N), else ``"cpu"``.
        profile_memory: if ``False``, only time is measured: ``peak_bytes`` and
            ``end_bytes`` are ``None`` and the timeline is empty.  Useful on CPU,
            where the profiler adds overhead to ``time_s``; on CUDA memory accounting
            is free, so there is no reason to turn it off.

    Returns:
        A :class:`Measurement`; ``str()`` of it reads e.g.
        ``"peak 3.81 MiB, end +3.81 MiB, 41 ms on cpu"``.

    Raises:
        TypeError: ``fn`` is not callable, or ``device`` has the wrong type.
        ValueError: ``device`` is not an accepted form, or names CUDA when CUDA is
            not available or the index does not exist.
        RuntimeError: CPU memory measurement was asked for while another torch
            profiler session (or an enclosing CPU ``measure``) is active, on any thread.
        Whatever ``fn`` raises is propagated unchanged.

    See the module docstring for how the numbers are obtained and their limits.
    """
    if not callable(fn):
        raise TypeError(
            f"measure() needs a callable as its first argument, got {type(fn).__name__} "
            f"({fn!r:.80}); pass the function itself, e.g. measure(model, x), or wrap "
            f"the work in a lambda: measure(lambda: model(x))."
        )
    if not isinstance(profile_memory, bool):
        raise TypeError(
            f"profile_memory must be a bool, got {type(profile_memory).__name__} "
            f"({profile_memory!r})."
        )
    roots = (fn, args, kwargs)
    dev = _resolve_device(device, roots)
    if dev.type == "cuda":
        return _measure_cuda(fn, args, kwargs, dev, profile_memory)
    return _measure_cpu(fn, args, kwargs, roots, profile_memory)


# ----------------------------------------------------------------------------- devices

_ACCEPTED_DEVICES = (
    '"cpu", "cuda", "cuda:N" (N a CUDA device index), a torch.device of those types, '
    "or None to infer"
)


def _resolve_device(device: str | torch.device | None, roots: tuple[Any, ...]) -> torch.device:
    if device is None:
        for t in _reachable_tensors(roots):
            if t.device.type == "cuda":
                index = t.device.index
                if index is None:
                    index = torch.cuda.current_device()
                return torch.device("cuda", index)
        return torch.device("cpu")

    if isinstance(device, str):
        try:
            dev = torch.device(device)
        except (RuntimeError, ValueError) as err:
            raise ValueError(
                f"device={device!r} is not a device torch understands ({err}); "
                f"accepted: {_ACCEPTED_DEVICES}."
            ) from None
    elif isinstance(device, torch.device):
        dev = device
    else:
        raise TypeError(
            f"device must be a str, a torch.device or None, got {type(device).__name__} "
            f"({device!r}); accepted: {_ACCEPTED_DEVICES}."
        )

    if dev.type == "cpu":
        if dev.index not in (None, 0):
            raise ValueError(f'device={device!r}: there is only one CPU device; use "cpu".')
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(
            f"device={device!r}: memfit can measure only CPU and CUDA memory, not {dev.type!r}; "
            f"accepted: {_ACCEPTED_DEVICES}."
        )
    if not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r} asks for CUDA, but CUDA is not available in this process "
            f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); "
            f'measure on "cpu" instead, or run on a machine with a GPU and a CUDA build of torch.'
        )
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise ValueError(
            f"device={device!r}: CUDA device index {index} does not exist; this machine has "
            f"{count} CUDA device(s), so use an index from 0 to {count - 1}."
        )
    return torch.device("cuda", index)


_ATOMS = (str, bytes, bytearray, int, float, complex, bool, type(None), type(Ellipsis))
_SKIP = (type, types.ModuleType, types.CodeType)
_BOUND_BUILTINS = (types.BuiltinMethodType, types.MethodWrapperType)  # e.g. some_list.clear


def _reachable_tensors(roots: Iterable[Any]) -> Iterator[torch.Tensor]:
    """Yield tensors reachable from ``roots`` (see "reachable" in the module docstring).

    Each object is visited once; the walk stops after ``_MAX_VISITED_OBJECTS``.
    """
    seen: set[int] = set()
    stack: list[Any] = list(roots)
    while stack and len(seen) < _MAX_VISITED_OBJECTS:
        obj = stack.pop()
        if isinstance(obj, _ATOMS) or id(obj) in seen:
            continue
        seen.add(id(obj))
        try:
            if isinstance(obj, torch.Tensor):
                yield obj
                if obj.is_leaf:  # .grad of a non-leaf warns and is always None
                    grad = obj.grad
                    if grad is not None:
                        stack.append(grad)
            elif isinstance(obj, _SKIP):
                continue
            elif isinstance(obj, torch.nn.Module):
                stack.extend(obj.parameters())
                stack.extend(obj.buffers())
                # tensors a module keeps as plain attributes (a cache, a random state): one the
                # call replaces is freed, which is seen only if it is watched
                stack.extend(
                    v
                    for m in obj.modules()
                    for v in vars(m).values()
                    if isinstance(v, torch.Tensor)
                )
            elif isinstance(obj, torch.optim.Optimizer):
                stack.append(obj.param_groups)
                stack.append(obj.state)
            elif isinstance(obj, Mapping):
                for key, value in obj.items():
                    stack.append(key)
                    stack.append(value)
            elif isinstance(obj, (list, tuple, set, frozenset, deque)):
                stack.extend(obj)
            elif isinstance(obj, functools.partial):
                stack.extend((obj.func, obj.args, obj.keywords))
            elif isinstance(obj, types.MethodType):
                stack.extend((obj.__self__, obj.__func__))
            elif isinstance(obj, _BOUND_BUILTINS):
                owner = getattr(obj, "__self__", None)
                if not isinstance(owner, types.ModuleType):  # torch.empty's __self__ is a module
                    stack.append(owner)
            elif isinstance(obj, types.FunctionType):
                stack.extend(_function_references(obj))
            elif hasattr(obj, "__dict__"):
                stack.append(vars(obj))
        except Exception:  # an exotic object we cannot look into: skip it
            continue


def _function_references(fn: types.FunctionType) -> list[Any]:
    refs: list[Any] = []
    for cell in fn.__closure__ or ():
        try:
            refs.append(cell.cell_contents)
        except ValueError:  # empty cell
            pass
    refs.extend(fn.__defaults__ or ())
    refs.extend((fn.__kwdefaults__ or {}).values())
    # Globals the code (or code nested in it, e.g. an inner lambda) names.
    glob = fn.__globals__
    codes = [fn.__code__]
    while codes:
        code = codes.pop()
        refs.extend(glob[name] for name in code.co_names if name in glob)
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return refs


# ----------------------------------------------------------------------------- per device


def _measure_cpu(
    fn: Callable[..., T],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    roots: tuple[Any, ...],
    profile_memory: bool,
) -> Measurement[T]:
    gc.collect()
    if not profile_memory:
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        elapsed = time.perf_counter() - start
        return Measurement(None, None, elapsed, "cpu", result, [])

    MemoryWindow.settle()  # a window's own recording gives way to the caller's
    reason = cpu_recording_blocked()
    if reason is not None:
        raise RuntimeError(
            f"measure() cannot measure CPU memory now: {reason}. Measure outside that "
            f"profiler, or pass profile_memory=False to measure time only."
        )
    with CpuRecording(watch=_reachable_tensors(roots)) as recording:
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        elapsed = time.perf_counter() - start
    memory = recording.memory(duration_s=elapsed)
    return Measurement(memory.peak_bytes, memory.end_bytes, elapsed, "cpu", result, memory.timeline)


def _measure_cuda(
    fn: Callable[..., T],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dev: torch.device,
    profile_memory: bool,
) -> Measurement[T]:
    index = dev.index
    name = f"cuda:{index}"
    gc.collect()
    if not profile_memory:
        torch.cuda.synchronize(index)
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        torch.cuda.synchronize(index)
        elapsed = time.perf_counter() - start
        return Measurement(None, None, elapsed, name, result, [])

    with CudaRecording(dev) as recording:
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        torch.cuda.synchronize(index)
        elapsed = time.perf_counter() - start
    end = recording.end_bytes
    return Measurement(recording.peak_bytes, end, elapsed, name, result, [(0.0, 0), (elapsed, end)])


# ----------------------------------------------------------------------------- formatting


def _format_seconds(s: float) -> str:
    if s >= 1.0:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"
