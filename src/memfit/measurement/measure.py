"""Measure the tensor memory and wall time of one call.

memfit's rule is that memory is *measured, never guessed*.  :func:`measure` runs a
callable exactly once and reports how much tensor memory it needed above what was
already live when it started.

Why not process RSS?
    RSS counts pages the C allocator has touched and not returned to the OS, the
    Python heap, shared libraries, and whatever other threads do.  It rises late
    (first touch), falls late or never (glibc keeps freed arenas), and cannot be
    attributed to one call.  A planner that compares "does this fit" against RSS
    deltas gets noise.  We want the exact number of bytes that tensors held.

CPU: profiler memory events
    With ``profile_memory=True`` the PyTorch profiler asks c10's CPU allocator to
    report every allocation and free as a ``"[memory]"`` event carrying the signed
    size (``nbytes()``), the device and a timestamp.  After the profiler stops we
    read the raw events from ``prof.profiler.kineto_results.events()`` (not
    ``key_averages()``, which aggregates sizes per operator and has no ordering, so
    it cannot give a peak), keep the CPU-device ones, sort them by time and take a
    running sum; its maximum is the peak.  The sizes are the bytes requested from
    the allocator (no alignment padding is added: ``torch.empty(1_000_000)`` is
    exactly 4,000,000 bytes).  Besides tensor storages this includes scratch
    buffers operators take from the same allocator, which is real memory too.

    One gap must be closed by hand: the CPU allocator only knows the size of blocks
    it allocated *while memory profiling was on*, so the free of a block allocated
    before the call is silently dropped (torch logs "Memory block of unknown size
    was allocated before the profiling started").  To still see pre-existing
    tensors freed by the call, :func:`measure` looks at the tensors reachable from
    ``fn`` and its arguments (see below) before the call and puts a weak reference
    on each CPU storage; the callback fires when the storage really dies and
    records the free with its time.  Frees of pre-existing storages that are *not*
    reachable that way are not seen; that can only make ``peak_bytes`` and
    ``end_bytes`` too high, never too low, which is the safe side for planning.

    The profiler records every operator, so on CPU ``time_s`` includes profiler
    overhead: negligible for big kernels (about 1-3 % on a 130 ms MLP step), large
    for many tiny ops (about 1.3 us per op, +40 % on a 50 ms loop of 16k small
    adds).  For clean timings call ``measure(fn, profile_memory=False)``, which
    measures time only.  The call to ``measure`` itself also takes longer than
    ``time_s``: stopping the profiler and reading its events costs a few
    microseconds per recorded event (about 1 s for 100k memory events).

CUDA: allocator statistics
    On CUDA the caching allocator keeps exact counters, so no profiler is needed:
    ``torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(dev);
    base = torch.cuda.memory_allocated(dev)``, run, synchronize, and
    ``peak = max_memory_allocated(dev) - base``, ``end = memory_allocated(dev) -
    base``.  These count bytes *allocated to tensors* (each block rounded up to
    the allocator's 512-byte granularity), not the *reserved* cache the allocator
    keeps from the driver, and not the CUDA context, cuBLAS/cuDNN handles or
    NCCL buffers.  Reserved memory is a property of the process's history, not
    of the call.  ``time_s`` is clean on CUDA.

    The CUDA timeline is only ``[(0.0, 0), (time_s, end_bytes)]``.  A full one
    would need ``torch.cuda.memory._record_memory_history``, which we do not use:
    it is process-global state that we could not restore (there is no getter, so
    a user's own recording would be clobbered), its signature changed between
    torch 2.0 and 2.1, and ``_snapshot()`` serialises the whole ring buffer and
    every segment, which is not cheap.

What counts as "reachable" (for device inference and pre-existing storages)
    Tensors among ``args``/``kwargs`` and, recursively, inside lists, tuples,
    sets, dicts, ``nn.Module`` parameters, buffers and their ``.grad``, optimizer
    state, ``functools.partial`` objects, bound methods, plain objects'
    attributes, and ``fn`` itself: its closure cells, defaults and the globals its
    code names.  The search is capped at 100,000 objects.

Other caveats
    * Warm-up is included: a first call that initialises lazy modules, cuBLAS
      workspaces or caches pays for them.  Measure a second call if you want the
      steady state.
    * ``gc.collect()`` runs before the measurement so that garbage from earlier
      code is not freed during the call (which would make the numbers too low).
      It costs roughly 0.1-0.3 s in a process that has imported torch.
    * Memory allocated on threads you start yourself inside ``fn`` is not seen by
      the CPU profiler (the profiler state is thread-local; autograd's threads do
      inherit it).  CUDA counters see everything on the device.
    * On CPU, ``measure`` cannot run while a torch profiler is already active
      (including a nested ``measure``); it raises instead of corrupting both.
      Nested CUDA measurements are supported.
    * Resizing a pre-existing storage in place (``Tensor.resize_``,
      ``untyped_storage().resize_``) frees its old block without a report on CPU.
"""

from __future__ import annotations

import functools
import gc
import time
import types
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from memfit.units import format_bytes

__all__ = ["Measurement", "measure"]

T = TypeVar("T")

_MEMORY_EVENT_NAME = "[memory]"  # torch.autograd.profiler_util.MEMORY_EVENT_NAME
_MAX_VISITED_OBJECTS = 100_000
# Kineto's timestamps and time.time_ns() share the Unix-epoch clock on every torch
# we support; allow this much disagreement before we stop trusting that.
_CLOCK_TOLERANCE_NS = 5_000_000
# Fallback only (no pointer information): a profiler free this close after a
# storage's weakref callback is taken to be the same free.
_SAME_FREE_WINDOW_NS = 1_000_000


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
        return f"peak {format_bytes(self.peak_bytes)}, end {format_bytes(self.end_bytes or 0, sign=True)}, {where}"


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
            profiler (or an enclosing CPU ``measure``) is active.
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

_ACCEPTED_DEVICES = '"cpu", "cuda", "cuda:N" (N a CUDA device index), a torch.device of those types, or None to infer'


def _resolve_device(device: str | torch.device | None, roots: tuple[Any, ...]) -> torch.device:
    if device is None:
        for t in _reachable_tensors(roots):
            if t.device.type == "cuda":
                return torch.device("cuda", t.device.index if t.device.index is not None else torch.cuda.current_device())
        return torch.device("cpu")

    if isinstance(device, str):
        try:
            dev = torch.device(device)
        except (RuntimeError, ValueError) as err:
            raise ValueError(
                f"device={device!r} is not a device torch understands ({err}); accepted: {_ACCEPTED_DEVICES}."
            ) from None
    elif isinstance(device, torch.device):
        dev = device
    else:
        raise TypeError(
            f"device must be a str, a torch.device or None, got {type(device).__name__} ({device!r}); "
            f"accepted: {_ACCEPTED_DEVICES}."
        )

    if dev.type == "cpu":
        if dev.index not in (None, 0):
            raise ValueError(f"device={device!r}: there is only one CPU device; use \"cpu\".")
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


# ----------------------------------------------------------------------------- CPU

def _profiler_active() -> bool:
    check = getattr(torch._C._autograd, "_profiler_enabled", None)
    if check is not None:
        return bool(check())
    return bool(getattr(torch.autograd.profiler, "_is_profiler_enabled", False))


class _PreexistingStorages:
    """Weak references on CPU storages alive before the call, to timestamp their frees.

    A storage's Python object is kept alive by the C++ storage for as long as that
    lives (PyObject preservation for storages, added around torch 2.1 and checked
    at runtime), so a weakref callback on it fires exactly when the memory is
    released.  Without preservation we fall back to checking at the end of the
    call whether each storage expired, and count those frees at the end (which can
    only make the peak higher).
    """

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        self.freed: list[tuple[int | None, int, int]] = []  # (time_ns or None, ptr, nbytes)
        self._refs: dict[int, Any] = {}  # ptr -> weakref (or StorageWeakRef) + info
        self._preserved = _storage_pyobject_preserved()
        if not self._preserved:
            from torch.multiprocessing.reductions import StorageWeakRef
        for t in tensors:
            if t.device.type != "cpu" or t.layout != torch.strided:
                continue
            try:
                storage = t.untyped_storage()
                ptr, nbytes = storage.data_ptr(), storage.nbytes()
            except Exception:  # tensor subclasses without real storage, etc.
                continue
            if nbytes == 0 or ptr in self._refs:
                continue
            if self._preserved:
                self._refs[ptr] = weakref.ref(storage, self._callback(ptr, nbytes))
            else:
                self._refs[ptr] = (StorageWeakRef(storage), nbytes)

    def _callback(self, ptr: int, nbytes: int) -> Callable[[Any], None]:
        freed = self.freed

        def on_free(_ref: Any) -> None:
            freed.append((time.time_ns(), ptr, nbytes))

        return on_free

    def close(self) -> None:
        """Stop watching.  Without preservation, collect expired storages now (time unknown)."""
        if not self._preserved:
            for ptr, (ref, nbytes) in self._refs.items():
                if ref.expired():
                    self.freed.append((None, ptr, nbytes))
        self._refs = {}  # dropping the weakrefs disarms their callbacks


@functools.lru_cache(maxsize=1)
def _storage_pyobject_preserved() -> bool:
    t = torch.empty(1)
    return t.untyped_storage() is t.untyped_storage()


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

    if _profiler_active():
        raise RuntimeError(
            "measure() cannot measure CPU memory while another torch profiler is running "
            "(a torch.profiler.profile context, or an enclosing measure() on CPU): the two "
            "would corrupt each other's results.  Measure outside that profiler, or pass "
            "profile_memory=False to measure time only."
        )

    from torch.profiler import ProfilerActivity, profile

    watch = _PreexistingStorages(_reachable_tensors(roots))
    prof = profile(
        activities=[ProfilerActivity.CPU],
        profile_memory=True,
        record_shapes=False,
        with_stack=False,
    )
    try:
        with prof:
            begin_ns = time.time_ns()
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            elapsed = time.perf_counter() - start
            end_ns = time.time_ns()
            watch.close()
    finally:
        watch.close()

    results = prof.profiler.kineto_results
    events = _kineto_cpu_memory_events(results)
    # Kineto stamps events on the Unix-epoch clock that time.time_ns() reads; check it.
    aligned = all(begin_ns - _CLOCK_TOLERANCE_NS <= t <= end_ns + _CLOCK_TOLERANCE_NS for t, _ in events)
    if not aligned:  # unknown clock: keep the order, count time from the first event
        begin_ns = min(t for t, _ in events)
        end_ns = max(t for t, _ in events) + 1
    if watch.freed:
        events = _merge_preexisting_frees(results, events, watch.freed, aligned, end_ns)

    events.sort(key=lambda e: (e[0], e[1] < 0))  # on ties, allocations first (upper bound)
    running = peak = 0
    timeline: list[tuple[float, int]] = [(0.0, 0)]
    for t, n in events:
        running += n
        peak = max(peak, running)
        seconds = (t - begin_ns) / 1e9
        timeline.append((min(max(0.0, seconds), elapsed) if aligned else seconds, running))
    return Measurement(peak, running, elapsed, "cpu", result, timeline)


def _event_start_ns(ev: Any) -> int:
    if hasattr(ev, "start_ns"):
        return int(ev.start_ns())
    return int(ev.start_us()) * 1000  # torch < 2.1 named it start_us


def _cpu_device_types() -> set[Any]:
    device_type = torch._C._autograd.DeviceType
    return {getattr(device_type, name) for name in ("CPU", "MKLDNN", "IDEEP") if hasattr(device_type, name)}


def _kineto_cpu_memory_events(results: Any) -> list[tuple[int, int]]:
    """``(start_ns, signed nbytes)`` of every CPU allocator event the profiler recorded."""
    if results is None:
        return []
    cpu = _cpu_device_types()
    out = []
    for ev in results.events():
        if ev.name() != _MEMORY_EVENT_NAME or ev.device_type() not in cpu:
            continue
        n = int(ev.nbytes())
        if n:
            out.append((_event_start_ns(ev), n))
    return out


def _tree_cpu_memory_events(results: Any) -> list[tuple[int, int, int]] | None:
    """``(start_ns, signed nbytes, ptr)`` of CPU allocator events, or None if unavailable.

    ``experimental_event_tree()`` (torch >= 2.0) carries the block address, which
    the flat kineto events do not.  It costs a walk over every event, so it is
    only used when a pre-existing storage died during the call.
    """
    try:
        from torch._C._profiler import _EventType

        out = []
        stack = list(results.experimental_event_tree())
        while stack:
            ev = stack.pop()
            stack.extend(ev.children)
            if ev.tag != _EventType.Allocation:
                continue
            fields = ev.extra_fields
            if fields.device.type != "cpu" or not fields.alloc_size:
                continue
            out.append((int(ev.start_time_ns), int(fields.alloc_size), int(fields.ptr)))
        return out
    except Exception:
        return None


def _merge_preexisting_frees(
    results: Any,
    events: list[tuple[int, int]],
    freed: list[tuple[int | None, int, int]],
    aligned: bool,
    end_ns: int,
) -> list[tuple[int, int]]:
    """Add the frees seen by weakref callbacks, without counting any free twice.

    A callback's time is used when the clocks agree (``aligned``), else the free is
    put at ``end_ns`` (after every profiler event), which can only raise the peak.

    A pre-existing block allocated during an *earlier* profiling session is known to
    the allocator, so the profiler reports its free as well.  With block addresses
    we drop exactly that report: a free of a watched address not preceded by an
    allocation of that address within the call.  Without addresses, we drop a
    profiler free of the same size within ``_SAME_FREE_WINDOW_NS`` after the
    callback.
    """
    extra = [((t if (t is not None and aligned) else end_ns), -nbytes) for t, _, nbytes in freed]
    with_ptrs = _tree_cpu_memory_events(results)
    if with_ptrs is not None:
        watched = {ptr for _, ptr, _ in freed}
        allocated_here: set[int] = set()
        handled: set[int] = set()
        kept = []
        for t, n, ptr in sorted(with_ptrs, key=lambda e: (e[0], e[1] < 0)):
            if n > 0:
                allocated_here.add(ptr)
            elif ptr in allocated_here:
                allocated_here.discard(ptr)
            elif ptr in watched and ptr not in handled:
                handled.add(ptr)
                continue  # the weakref callback already accounts for this free
            kept.append((t, n))
        return kept + extra

    if not aligned:
        return events + extra
    claimed: set[int] = set()
    for t_free, _, nbytes in freed:
        if t_free is None:
            continue
        for i, (t, n) in enumerate(events):
            if i not in claimed and n == -nbytes and t_free <= t <= t_free + _SAME_FREE_WINDOW_NS:
                claimed.add(i)
                break
    return [e for i, e in enumerate(events) if i not in claimed] + extra


# ----------------------------------------------------------------------------- CUDA


@dataclass
class _CudaFrame:
    index: int
    peak_abs: int


# Enclosing CUDA measurements: an inner reset_peak_memory_stats would erase their
# peak, so it first folds the current peak into every enclosing frame.
_cuda_frames: list[_CudaFrame] = []


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
    torch.cuda.synchronize(index)
    if not profile_memory:
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        torch.cuda.synchronize(index)
        elapsed = time.perf_counter() - start
        return Measurement(None, None, elapsed, name, result, [])

    for frame in _cuda_frames:
        if frame.index == index:
            frame.peak_abs = max(frame.peak_abs, torch.cuda.max_memory_allocated(index))
    torch.cuda.reset_peak_memory_stats(index)
    base = torch.cuda.memory_allocated(index)
    frame = _CudaFrame(index, base)
    _cuda_frames.append(frame)
    try:
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        torch.cuda.synchronize(index)
        elapsed = time.perf_counter() - start
        peak_abs = max(frame.peak_abs, torch.cuda.max_memory_allocated(index))
        end = torch.cuda.memory_allocated(index) - base
    finally:
        _cuda_frames.remove(frame)
    # Let an enclosing measurement see this call's peak even though we reset it.
    for outer in _cuda_frames:
        if outer.index == index:
            outer.peak_abs = max(outer.peak_abs, peak_abs)
    peak = max(0, peak_abs - base, end)
    return Measurement(peak, end, elapsed, name, result, [(0.0, 0), (elapsed, end)])


# ----------------------------------------------------------------------------- formatting


def _format_seconds(s: float) -> str:
    if s >= 1.0:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"
