"""CPU tensor memory, counted exactly from the profiler's allocator events.

Why not process RSS?
    RSS counts pages the C allocator has touched and not returned to the OS, the Python heap,
    shared libraries, and whatever other threads do. It rises late (first touch), falls late or
    never (glibc keeps freed arenas), and cannot be attributed to one call. A planner that compares
    "does this fit" against RSS deltas gets noise. We want the exact number of bytes tensors held.

Profiler memory events
    With ``profile_memory=True`` the PyTorch profiler asks c10's CPU allocator to report every
    allocation and free as a ``"[memory]"`` event carrying the signed size (``nbytes()``), the
    device and a timestamp. After a session stops we read the raw events (not ``key_averages()``,
    which aggregates sizes per operator and has no ordering, so it cannot give a peak), keep the
    CPU-device ones, sort them by time and take a running sum; its maximum is the peak. The sizes
    are the bytes requested from the allocator (no alignment padding: ``torch.empty(1_000_000)`` is
    exactly 4,000,000 bytes). Besides tensor storages this includes scratch buffers operators take
    from the same allocator, which is real memory too.

Pre-existing storages
    The CPU allocator only knows the size of blocks it allocated *while memory profiling was on*,
    so the free of a block allocated before is silently dropped (torch logs "Memory block of
    unknown size was allocated before the profiling started"). To still see pre-existing tensors
    freed inside a recording, the caller names tensors to watch (``measure`` passes those reachable
    from its ``fn`` and arguments); a weak reference on each CPU storage fires when the storage
    really dies and records the free with its time. A storage's Python object lives exactly as
    long as its C++ storage (PyObject preservation, always on in the torch releases memfit
    supports), so the callback's time is the free's time. Frees of pre-existing storages nobody
    watched are not seen; that can only make ``peak_bytes`` and ``end_bytes`` too high, never too
    low, which is the safe side for planning.

Cost
    The profiler records every operator, so a recorded call runs slower: negligible for big kernels
    (about 1-3 % on a 130 ms MLP step), large for many tiny ops (about 1.3 us per op, +40 % on a
    50 ms loop of 16k small adds). Stopping a session and reading its events costs a few
    microseconds per recorded event (about 1 s for 100k memory events); starting and stopping an
    empty session about 0.5 ms (the first one in a process, about 80 ms).

Limits
    * Memory allocated on threads you start yourself is not seen (the profiler state is
      thread-local; autograd's threads inherit it). Nor is a free there: a tensor made in the
      recording whose last reference another thread drops (a gloo worker finishing a collective
      after the caller has moved on) stays counted to the end, which can only raise the figures.
    * Resizing a pre-existing storage in place (``Tensor.resize_``, ``untyped_storage().resize_``)
      frees its old block without a report.
    * Only one profiler session can be active, so a recording cannot begin while another one
      runs: memfit's own, one a user started (a ``torch.profiler.profile`` context), or one on
      another thread (opening a second session there crashes the process).
      :func:`cpu_recording_blocked` says which; callers that must measure anyway do it in another
      process (``memfit.analysis.op_scratch``).

NOTE [Why CPU recordings do not nest by pausing]
    Sessions in sequence do compose: c10's allocator keeps its table of block sizes across
    sessions, so stopping an enclosing session, running an inner one and starting a third gives
    the exact running total when the three event lists are concatenated. But it is not safe. A
    C++ ``RecordFunction`` range (every ATen op and autograd node; the ranges Dynamo and
    AOTAutograd open with ``_RecordFunctionFast`` around compilation) that begins in one session
    keeps a pointer into that session's event buffer; if it ends while a *later* session is
    active, the profiler writes through the pointer into freed memory.
    Checked on torch 2.13: an inner recording inside a tensor's backward hook segfaults, one inside
    ``torch.compile``'s capture corrupts the heap (``free(): invalid next size``), while the same
    pause in plain Python code works. Python cannot see which ranges are open, so memfit never
    pauses a session, and a recording refuses to begin inside another.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from memfit._compat import (
    cpu_memory_device_types,
    profiler_allocations,
    profiler_enabled,
    profiler_events,
    profiler_started_anywhere,
)

__all__ = ["CpuMemory", "CpuRecording", "cpu_recording_blocked"]

_MEMORY_EVENT_NAME = "[memory]"  # torch.autograd.profiler_util.MEMORY_EVENT_NAME
# Kineto's timestamps and time.time_ns() share the Unix-epoch clock on every torch we support;
# allow this much disagreement before we stop trusting that.
_CLOCK_TOLERANCE_NS = 5_000_000
# Fallback only (no block addresses): a profiler free this close after a watched storage's
# weakref callback is taken to be the same free.
_SAME_FREE_WINDOW_NS = 1_000_000


@dataclass(frozen=True)
class CpuMemory:
    """What a :class:`CpuRecording` saw, in bytes above what was live when it began.

    Attributes:
        peak_bytes: highest live tensor memory during the recording, never below 0.
        end_bytes: live at the end; negative when the recording freed more than it kept.
        timeline: ``(seconds since the recording began, live bytes)`` after each allocation or
            free, starting with ``(0.0, 0)``.
    """

    peak_bytes: int
    end_bytes: int
    timeline: list[tuple[float, int]]


def cpu_recording_blocked() -> str | None:
    """Why a :class:`CpuRecording` cannot begin now, or None when it can.

    It cannot while any torch profiler session runs in the process, memfit's own included (see
    NOTE [Why CPU recordings do not nest by pausing]).
    """
    if profiler_enabled() or profiler_started_anywhere():
        return (
            "another torch profiler is running (a torch.profiler.profile context, an enclosing "
            "CPU measurement, or a session on another thread), and a second session would "
            "corrupt both"
        )
    return None


class CpuRecording:
    """Records CPU tensor memory from ``__enter__`` to ``__exit__``; read it with :meth:`memory`.

    Args:
        watch: tensors alive before the recording whose frees should be seen (see "Pre-existing
            storages" in the module docstring); only CPU tensors with strided storage count.

    Raises:
        RuntimeError: on entry, when :func:`cpu_recording_blocked` gives a reason.
    """

    #: the recording now running in this process, if one is (only one can)
    current: CpuRecording | None = None

    def __init__(self, watch: Iterable[torch.Tensor] = ()) -> None:
        self._watch = watch
        self._storages: _PreexistingStorages | None = None
        self._prof: profile | None = None
        self._begin_ns = 0
        self._end_ns: int | None = None
        self._requests: list[tuple[int, int, Callable[[int], None]]] = []
        self._level_requests: list[tuple[list[int], Callable[[list[int]], None]]] = []

    def request_window(self, start_ns: int, end_ns: int, deliver: Callable[[int], None]) -> None:
        """When this recording ends, call ``deliver`` with the peak inside ``[start_ns, end_ns]``
        (``time.time_ns()`` values), above what was live at ``start_ns``; see ``window_peaks``.

        How code that wants a window's peak gets it while someone else's recording runs; a
        window that closes after the recording ended gets nothing.
        """
        if self._end_ns is None:
            self._requests.append((start_ns, end_ns, deliver))

    def request_levels(self, times_ns: list[int], deliver: Callable[[list[int]], None]) -> None:
        """When this recording ends, call ``deliver`` with the bytes live at each of
        ``times_ns`` (``time.time_ns()`` values, in order), above what was live at the first;
        see ``levels``."""
        if self._end_ns is None:
            self._level_requests.append((list(times_ns), deliver))

    def __enter__(self) -> CpuRecording:
        reason = cpu_recording_blocked()
        if reason is not None:
            raise RuntimeError(f"memfit cannot record CPU memory now: {reason}.")
        # Weak references first: making them allocates no tensor memory.
        self._storages = _PreexistingStorages(self._watch)
        self._watch = ()  # weak references only: holding the tensors would keep them alive
        self._prof = profile(
            activities=[ProfilerActivity.CPU],
            profile_memory=True,
            record_shapes=False,
            with_stack=False,
        )
        self._prof.start()
        self._begin_ns = time.time_ns()
        CpuRecording.current = self
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._end_ns = time.time_ns()
        try:
            if self._storages is not None:
                self._storages.close()
        finally:
            if CpuRecording.current is self:
                CpuRecording.current = None
            if self._prof is not None:
                self._prof.stop()
        requests, self._requests = self._requests, []
        for start, end, deliver in requests:
            try:
                (peak,) = self.window_peaks([(start, end)])
            except RuntimeError:  # the profiler's clock is not time.time_ns()'s: no window
                continue
            deliver(peak)
        level_requests, self._level_requests = self._level_requests, []
        for times, deliver_levels in level_requests:
            try:
                found = self.levels(times)
            except RuntimeError:
                continue
            deliver_levels(found)

    def memory(self, *, duration_s: float | None = None) -> CpuMemory:
        """The recorded memory; timeline times are clamped to ``[0, duration_s]`` when given.

        Raises:
            RuntimeError: the recording has not ended yet.
        """
        events, aligned, begin_ns, end_ns = self._events()
        running = peak = 0
        timeline: list[tuple[float, int]] = [(0.0, 0)]
        limit = duration_s if duration_s is not None else (end_ns - begin_ns) / 1e9
        for t, n in events:
            running += n
            peak = max(peak, running)
            seconds = (t - begin_ns) / 1e9
            timeline.append((min(max(0.0, seconds), limit) if aligned else seconds, running))
        return CpuMemory(peak, running, timeline)

    def window_peaks(self, windows: list[tuple[int, int]]) -> list[int]:
        """Peak live bytes inside each ``(start_ns, end_ns)`` window (``time.time_ns()`` values
        taken during the recording), above what was live when the window began.

        One recording with many windows costs one profiler session, where a recording per window
        would cost a session each. Windows must not overlap and come in time order.

        Raises:
            RuntimeError: the recording has not ended yet, or the profiler's clock is not
                ``time.time_ns()``'s (then windows cannot be placed).
        """
        events, aligned, _, _ = self._events()
        if not aligned:
            raise RuntimeError("the profiler's clock does not match time.time_ns(): no windows")
        peaks: list[int] = []
        running, i = 0, 0
        for start, end in windows:
            while i < len(events) and events[i][0] < start:
                running += events[i][1]
                i += 1
            base = peak = running
            while i < len(events) and events[i][0] <= end:
                running += events[i][1]
                peak = max(peak, running)
                i += 1
            peaks.append(peak - base)
        return peaks

    def levels(self, times_ns: list[int]) -> list[int]:
        """Bytes live at each of ``times_ns`` (``time.time_ns()`` values taken during the
        recording, in order), above what was live at the first: what a step holds at each point
        a caller marked (``measurement.window.MemoryLevels``).

        Raises:
            RuntimeError: as ``window_peaks``.
        """
        events, aligned, _, _ = self._events()
        if not aligned:
            raise RuntimeError("the profiler's clock does not match time.time_ns(): no levels")
        found: list[int] = []
        running, i = 0, 0
        for t in times_ns:
            while i < len(events) and events[i][0] < t:
                running += events[i][1]
                i += 1
            found.append(running)
        return [level - found[0] for level in found] if found else []

    def _events(self) -> tuple[list[tuple[int, int]], bool, int, int]:
        """``(time_ns, signed bytes)`` in order, whether their clock is ``time.time_ns()``'s, and
        the recording's begin and end on that clock."""
        prof, storages = self._prof, self._storages
        if self._end_ns is None or prof is None or storages is None:
            raise RuntimeError("CpuRecording results are available once the recording has ended")
        begin_ns, end_ns = self._begin_ns, self._end_ns
        events = _cpu_memory_events(prof)
        # Kineto stamps events on the Unix-epoch clock that time.time_ns() reads; check it.
        tol = _CLOCK_TOLERANCE_NS
        aligned = all(begin_ns - tol <= t <= end_ns + tol for t, _ in events)
        if not aligned:  # unknown clock: keep the order, count time from the first event
            begin_ns = min(t for t, _ in events)
            end_ns = max(t for t, _ in events) + 1
        if storages.freed:
            events = _merge_preexisting_frees(prof, events, storages.freed, aligned, end_ns)
        events.sort(key=lambda e: (e[0], e[1] < 0))  # on ties, allocations first (upper bound)
        return events, aligned, begin_ns, end_ns


class _PreexistingStorages:
    """Weak references on CPU storages alive before a recording, to timestamp their frees."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        self.freed: list[tuple[int, int, int]] = []  # (time_ns, address, nbytes)
        self._refs: dict[int, weakref.ref[Any]] = {}  # address -> weak reference
        for t in tensors:
            if t.device.type != "cpu" or t.layout != torch.strided:
                continue
            try:
                storage = t.untyped_storage()
                ptr, nbytes = storage.data_ptr(), storage.nbytes()
            except Exception:  # tensor subclasses without real storage, etc.
                continue
            if nbytes and ptr not in self._refs:
                self._refs[ptr] = weakref.ref(storage, self._callback(ptr, nbytes))

    def _callback(self, ptr: int, nbytes: int) -> Callable[[Any], None]:
        freed = self.freed

        def on_free(_ref: Any) -> None:
            freed.append((time.time_ns(), ptr, nbytes))

        return on_free

    def close(self) -> None:
        """Stop watching: dropping the weak references disarms their callbacks."""
        self._refs = {}


def _cpu_memory_events(prof: profile) -> list[tuple[int, int]]:
    """``(start_ns, signed bytes)`` of every CPU allocator event of a finished session."""
    cpu = cpu_memory_device_types()
    out = []
    for ev in profiler_events(prof):
        if ev.name() == _MEMORY_EVENT_NAME and ev.device_type() in cpu:
            n = int(ev.nbytes())
            if n:
                out.append((int(ev.start_ns()), n))
    return out


def _merge_preexisting_frees(
    prof: profile,
    events: list[tuple[int, int]],
    freed: list[tuple[int, int, int]],
    aligned: bool,
    end_ns: int,
) -> list[tuple[int, int]]:
    """Add the frees seen by weakref callbacks, without counting any free twice.

    A callback's time is used when the clocks agree (``aligned``), else the free is put at
    ``end_ns`` (after every profiler event), which can only raise the peak.

    A pre-existing block allocated during an *earlier* profiling session is known to the
    allocator, so the profiler reports its free as well. With block addresses we drop exactly
    that report: a free of a watched address not preceded by an allocation of that address within
    the recording. Without addresses, we drop a profiler free of the same size within
    ``_SAME_FREE_WINDOW_NS`` after the callback.
    """
    extra = [((t if aligned else end_ns), -nbytes) for t, _, nbytes in freed]
    with_ptrs = profiler_allocations(prof)
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
        for i, (t, n) in enumerate(events):
            if i not in claimed and n == -nbytes and t_free <= t <= t_free + _SAME_FREE_WINDOW_NS:
                claimed.add(i)
                break
    return [e for i, e in enumerate(events) if i not in claimed] + extra
