"""The store behind offload: private disk files written and read by two threads, or (CUDA) a
pinned host arena and two copy streams; slots named by handles the graphs carry.

Part of ``memfit.execution.offload``: see its docstring.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from memfit.execution.offload.offload_options import OffloadError, OffloadTarget, check_directory

__all__ = [
    "Arena",
    "DEBUG_DELAY_S",
    "DEBUG_POISON",
    "OffloadStore",
    "store_for",
]


# ---- the store -------------------------------------------------------------------------------


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s storage it covers, as a flat uint8 tensor (no copy)."""
    n = t.numel() * t.element_size()
    view = torch.empty(0, dtype=torch.uint8, device=t.device)
    return view.set_(t.untyped_storage(), t.storage_offset() * t.element_size(), (n,), (1,))


@dataclass
class _Slot:
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    nbytes: int
    source: torch.Tensor | None = None
    #: set by ``offload_wait``: from then on the backward's handle decides when the slot goes
    owned: bool = False
    written: Future[None] | None = None
    read: Future[None] | None = None
    buffer: torch.Tensor | None = None
    path: str | None = None
    # host destination (CUDA): arena region and the events bounding its use
    region: tuple[int, int, int] | None = None
    copied_out: Any = None
    copied_in: Any = None
    host: torch.Tensor | None = None


#: Test hook: seconds every background copy sleeps before it runs, and whether reload buffers
#: are filled with NaN first, so a missing wait reads garbage deterministically.
DEBUG_DELAY_S = 0.0
DEBUG_POISON = False


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    else:
        t.fill_(-1)


class Arena:
    """Pinned host memory reused across steps: chunks allocated once, regions first-fit.

    ``reserve`` sizes the first chunk to what a plan offloads, so a step's regions come from one
    allocation; later steps take the same regions again (freed regions are merged with their
    neighbours, so the free list does not fragment from step to step). A freed region carries the
    events of the copies that last read it; the next copy into it waits for them on its own
    stream, so a region is never overwritten while a reload still reads it.
    """

    ALIGN = 512

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.chunks: list[torch.Tensor] = []
        #: free regions: (chunk, offset, length, events of the copies that last read them)
        self.free: list[tuple[int, int, int, tuple[Any, ...]]] = []
        self.allocated_bytes = 0

    def _round(self, nbytes: int) -> int:
        return (nbytes + self.ALIGN - 1) // self.ALIGN * self.ALIGN

    def reserve(self, sizes: list[int]) -> None:
        """Make sure values of ``sizes`` (one step's offload) fit without allocating again."""
        need = sum(self._round(n) for n in sizes)
        free = sum(length for _, _, length, _ in self.free)
        if free < need:
            self._grow(need - free)

    def _grow(self, size: int) -> None:
        self.chunks.append(torch.empty(size, dtype=torch.uint8, pin_memory=self.pin))
        self.allocated_bytes += size
        self.give((len(self.chunks) - 1, 0, size), ())

    def take(self, nbytes: int) -> tuple[torch.Tensor, tuple[int, int, int], tuple[Any, ...]]:
        nbytes = self._round(nbytes)
        for i, (chunk, offset, length, events) in enumerate(self.free):
            if length >= nbytes:
                if length == nbytes:
                    self.free.pop(i)
                else:
                    self.free[i] = (chunk, offset + nbytes, length - nbytes, events)
                view = self.chunks[chunk][offset : offset + nbytes]
                return view, (chunk, offset, nbytes), events
        self._grow(max(nbytes, 64 * 2**20, self.allocated_bytes // 2))
        return self.take(nbytes)

    def give(self, region: tuple[int, int, int], events: tuple[Any, ...]) -> None:
        chunk, offset, length = region
        self.free.append((chunk, offset, length, events))
        self.free.sort(key=lambda r: (r[0], r[1]))
        merged: list[tuple[int, int, int, tuple[Any, ...]]] = []
        for c, o, n, ev in self.free:
            if merged and merged[-1][0] == c and merged[-1][1] + merged[-1][2] == o:
                pc, po, pn, pev = merged[-1]
                pending = tuple(e for e in (*pev, *ev) if not _done(e))
                merged[-1] = (pc, po, pn + n, pending)
            else:
                merged.append((c, o, n, ev))
        self.free = merged


def _done(event: Any) -> bool:
    return event is None or bool(event.query())


class OffloadStore:
    """Where one wrapper's offloaded values live between their forward and their backward."""

    def __init__(self, to: str, directory: str | None = None) -> None:
        OffloadTarget.parse(to, "an offload destination", "memfit.OffloadTarget")
        self.to = to
        self.slots: dict[int, _Slot] = {}
        self._lock = threading.Lock()
        self._out = ThreadPoolExecutor(1, thread_name_prefix="memfit-offload-out")
        self._in = ThreadPoolExecutor(1, thread_name_prefix="memfit-offload-in")
        self.directory: str | None = None
        self._arena: Arena | None = None
        self._streams: tuple[Any, Any] | None = None
        if to == "disk":
            parent = directory or tempfile.gettempdir()
            check_directory(parent)
            try:
                self.directory = tempfile.mkdtemp(prefix="memfit-offload-", dir=parent)
            except OSError as exc:
                raise OffloadError(
                    f"cannot create an offload directory in {parent!r}: {exc}"
                ) from exc
        self.id = next(_ids)
        _STORES[self.id] = self
        self._finalizer = weakref.finalize(
            self, _close, self.id, self.directory, self._out, self._in
        )

    # -- bookkeeping --
    @property
    def pending_files(self) -> list[str]:
        """Offload files that exist now (a finished step leaves none)."""
        if self.directory is None or not os.path.isdir(self.directory):
            return []
        return sorted(os.listdir(self.directory))

    def free_disk_bytes(self) -> int | None:
        """Free bytes where the offload directory is (``"disk"``), None otherwise."""
        if self.directory is None:
            return None
        return shutil.disk_usage(self.directory).free

    @property
    def host_arena_bytes(self) -> int:
        """Pinned host memory the store holds (``"host"`` only)."""
        return self._arena.allocated_bytes if self._arena else 0

    def reserve(self, sizes: list[int]) -> None:
        """Hold pinned host memory for values of ``sizes``, what one step offloads (``"host"``).

        Called when a graph is planned, so the arena is allocated once, before the first step,
        instead of growing value by value.
        """
        if self.to == "host":
            if self._arena is None:
                self._arena = Arena(pin=True)
            self._arena.reserve(sizes)

    def close(self) -> None:
        """Drop every value and remove the offload directory."""
        self._finalizer()

    def release_unowned(self, key: int) -> None:
        """Release slot ``key`` unless ``offload_wait`` handed it to the backward."""
        slot = self.slots.get(key)
        if slot is not None and not slot.owned:
            self.release(key)

    def release(self, key: int) -> None:
        """Forget slot ``key``: its value is not needed any more (read back, or step abandoned)."""
        with self._lock:
            slot = self.slots.pop(key, None)
        if slot is None:
            return
        if slot.buffer is not None and slot.copied_in is not None:
            # a reload released before its wait (the backward raised): the buffer goes back to
            # the compute stream's pool only after the side stream has finished writing it
            torch.cuda.current_stream(slot.device).wait_event(slot.copied_in)
        for future in (slot.written, slot.read):
            if future is not None:
                try:
                    future.result()
                except Exception:
                    pass
        if slot.path is not None:
            _remove(slot.path)
        if slot.region is not None and self._arena is not None:
            self._arena.give(slot.region, (slot.copied_in,) if slot.copied_in else ())

    # -- the four operations --
    def offload(self, x: torch.Tensor) -> int:
        key = next(_keys)
        slot = _Slot(
            size=tuple(x.shape),
            stride=tuple(x.stride()),
            dtype=x.dtype,
            device=x.device,
            nbytes=x.numel() * x.element_size(),
            source=x,
        )
        with self._lock:
            self.slots[key] = slot
        if self.to == "disk":
            assert self.directory is not None
            slot.path = os.path.join(self.directory, f"{key}.bin")
            ready = _record_event(x.device)
            slot.written = self._out.submit(_write_file, [x], slot.path, ready)
        else:
            self._copy_out_to_host(slot, x)
        return key

    def wait_out(self, key: int) -> None:
        slot = self._slot(key)
        if slot.written is not None:
            try:
                slot.written.result()
            except OSError as exc:
                self.release(key)
                raise OffloadError(
                    f"memfit could not write an offloaded activation ({slot.nbytes} bytes) to "
                    f"{self.directory}: {exc}; free disk space or pass "
                    f"options=memfit.Options(offload_dir=...) on a larger disk (the step's "
                    f"offload files were removed)"
                ) from exc
        if slot.copied_out is not None:
            torch.cuda.current_stream(slot.device).wait_event(slot.copied_out)
        slot.source = None  # the copy is done (or ordered before any reuse): let the value die

    def reload_start(self, key: int) -> None:
        slot = self._slot(key)
        buffer = torch.empty_strided(slot.size, slot.stride, dtype=slot.dtype, device=slot.device)
        if DEBUG_POISON:
            _poison(buffer)
        slot.buffer = buffer
        if self.to == "disk":
            assert slot.path is not None
            ready = _record_event(slot.device)
            slot.read = self._in.submit(_read_file, buffer, slot.path, ready)
        else:
            self._copy_in_from_host(slot, buffer)

    def _slot(self, key: int) -> _Slot:
        slot = self.slots.get(key)
        if slot is None:
            raise OffloadError(
                "an offloaded activation was released before its backward read it: the backward "
                "of this step ran twice (retain_graph=True is not supported with offload) or the "
                "offload store was closed"
            )
        return slot

    def reload_wait(self, key: int) -> torch.Tensor:
        slot = self._slot(key)
        if slot.buffer is None:  # no prefetch was placed: start the copy now
            self.reload_start(key)
        if slot.read is not None:
            slot.read.result()  # on CUDA, _read_file synchronised its own stream
        if slot.copied_in is not None:
            torch.cuda.current_stream(slot.device).wait_event(slot.copied_in)
        buffer = slot.buffer
        assert buffer is not None
        slot.buffer = None
        self.release(key)
        return buffer

    # -- CUDA host destination --
    def _cuda_streams(self, device: torch.device) -> tuple[Any, Any]:
        if self._streams is None:
            self._streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._streams

    def _copy_out_to_host(self, slot: _Slot, x: torch.Tensor) -> None:
        if x.device.type != "cuda":
            raise OffloadError("offload_to='host' needs CUDA tensors")
        if self._arena is None:
            self._arena = Arena(pin=True)
        out_stream, _ = self._cuda_streams(x.device)
        host, slot.region, last_reads = self._arena.take(slot.nbytes)
        out_stream.wait_stream(torch.cuda.current_stream(x.device))
        for event in last_reads:
            out_stream.wait_event(event)
        with torch.cuda.stream(out_stream):
            host[: slot.nbytes].copy_(_byte_view(x), non_blocking=True)
            slot.copied_out = out_stream.record_event()
        slot.host = host

    def _copy_in_from_host(self, slot: _Slot, buffer: torch.Tensor) -> None:
        _, in_stream = self._cuda_streams(buffer.device)
        in_stream.wait_stream(torch.cuda.current_stream(buffer.device))
        in_stream.wait_event(slot.copied_out)
        with torch.cuda.stream(in_stream):
            assert slot.host is not None
            _byte_view(buffer).copy_(slot.host[: slot.nbytes], non_blocking=True)
            slot.copied_in = in_stream.record_event()


def _record_event(device: torch.device) -> Any:
    if device.type != "cuda":
        return None
    return torch.cuda.current_stream(device).record_event()


def _write_file(box: list[torch.Tensor], path: str, ready: Any) -> None:
    """Write the tensor in ``box`` to ``path``. The tensor comes in a box the worker empties, so
    nothing of this thread (its work item, a failure's traceback) keeps it alive once the write
    is done: ``offload_wait`` frees the value exactly where the plan says."""
    x: torch.Tensor | None = box.pop()
    data: torch.Tensor | None = None
    try:
        assert x is not None
        if DEBUG_DELAY_S:
            time.sleep(DEBUG_DELAY_S)
        if ready is not None:  # CUDA value to disk: copy to host on this thread's own stream
            stream = torch.cuda.Stream(x.device)
            stream.wait_event(ready)
            with torch.cuda.stream(stream):
                data = _byte_view(x).to("cpu")
        else:
            data = _byte_view(x)
        x = None
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(_buffer(data))
    except BaseException:
        x = data = None  # the traceback keeps this frame: drop the tensors first
        _remove(path)
        raise
    finally:
        data = None


def _read_file(buffer: torch.Tensor, path: str, ready: Any) -> None:
    if DEBUG_DELAY_S:
        time.sleep(DEBUG_DELAY_S)
    if ready is not None:
        host = torch.empty(buffer.numel() * buffer.element_size(), dtype=torch.uint8)
        with open(path, "rb") as f:
            f.readinto(_buffer(host))
        stream = torch.cuda.Stream(buffer.device)
        stream.wait_event(ready)
        with torch.cuda.stream(stream):
            _byte_view(buffer).copy_(host)
        stream.synchronize()
    else:
        with open(path, "rb") as f:
            f.readinto(_buffer(_byte_view(buffer)))
    _remove(path)


def _buffer(t: torch.Tensor) -> memoryview:
    """A writable view of a CPU uint8 tensor's bytes, for file I/O without a copy."""
    return memoryview(t.numpy())  # type: ignore[arg-type]


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _close(
    store_id: int, directory: str | None, out: ThreadPoolExecutor, into: ThreadPoolExecutor
) -> None:
    _STORES.pop(store_id, None)
    out.shutdown(wait=True)
    into.shutdown(wait=True)
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


_ids = itertools.count(1)
_keys = itertools.count(1)
_STORES: weakref.WeakValueDictionary[int, OffloadStore] = weakref.WeakValueDictionary()


def store_for(store_id: int) -> OffloadStore:
    store = _STORES.get(store_id)
    if store is None:
        raise OffloadError(
            f"offload store {store_id} is closed (store.close() was called, or the model that "
            f"planned this graph was deleted or had memfit removed): apply memfit again to "
            f"train it"
        )
    return store


def _handle(store: OffloadStore, key: int, *, owns: bool) -> torch.Tensor:
    """A handle naming slot ``key``. The owning handle (``offload_wait``'s, which the backward
    receives) releases the slot when it dies: a step abandoned before its backward leaves
    nothing behind. The first handle releases it only if no owner ever came: a forward that
    raised between ``offload`` and ``offload_wait`` must not keep its source alive."""
    handle = torch.tensor(key, dtype=torch.int64)
    weakref.finalize(handle, store.release if owns else store.release_unowned, key)
    return handle
