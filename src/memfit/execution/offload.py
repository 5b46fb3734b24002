"""Offload and reload as operations in the forward and backward graphs, and the store behind them.

Why operations in the graphs rather than saved-tensor hooks: hooks fire where autograd saves a
tensor, which under ``torch.compile`` is the compiled region's boundary (they save nothing there,
pytorch#148222), and they cannot say *when* a copy must be complete. Here the plan names, for each
offloaded value, the forward node after which its copy out is waited for and the backward node
before which its copy back starts (``analysis.transfers``); four custom ops put exactly that into
the graphs the executor runs:

* ``memfit::offload(x, store)`` right after ``x`` is produced: starts the copy out, returns a
  handle (a 0-d int64 CPU tensor naming the slot). The store holds ``x`` until the copy is done.
* ``memfit::offload_wait(x, handle)`` at ``wait_after``: blocks until the copy is done and returns
  a fresh handle; the forward saves that handle for backward instead of ``x``, so the device copy
  dies right there (its last reader) — not earlier, which would race the copy, and not later.
* ``memfit::reload_start(handle)`` at ``prefetch_before``: allocates the device buffer and starts
  the copy back.
* ``memfit::reload_wait(handle, token, ...)`` just before the first backward reader: blocks until
  the buffer is filled and returns it.

Destinations. ``"disk"`` (CPU, and CUDA as an option): one file per value, in a private directory
(``tempfile.mkdtemp``: mode 0700; each file 0600) under ``offload_dir`` or the system temp dir,
written and read by two background threads (one per direction, so copies overlap compute and
each direction is a FIFO queue, as the simulator models it). A file is removed when its value is
read back, when its handle dies without a backward (the step was abandoned), and the directory
when the store is closed or the interpreter exits. ``"host"`` (CUDA only): copies on two side
streams into one pinned host arena that grows to the largest step's need and is then reused, so
no pinned allocation happens after the first step; a source stays referenced until the compute
stream has waited for its copy's event (no ``record_stream``), and a reloaded region is reused only
after its copy-in event.

Values are copied as their raw storage bytes and reloaded into ``torch.empty_strided`` with their
original sizes and strides, so the backward reads bit-identical tensors with identical layouts.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from memfit.analysis.transfers import Link
from memfit.measurement.timing import synchronize
from memfit.planning.budget import parse_budget

#: ``node.meta`` key (set by ``execution.partition``): the joint-graph name of a node that took
#: another's place in the forward graph.
JOINT_NAME = "memfit_joint_name"

__all__ = [
    "OFFLOAD_DESTINATIONS",
    "check_directory",
    "OffloadError",
    "OffloadOptions",
    "OffloadStore",
    "insert_transfers",
    "copy_overlap",
    "measure_link",
    "store_for",
]

OFFLOAD_DESTINATIONS = ("host", "disk")


class OffloadError(RuntimeError):
    """Offloading cannot work as asked: a bad directory, a full disk, host offload without CUDA."""


@dataclass(frozen=True)
class OffloadOptions:
    """Where offloaded values go. ``to=None`` picks ``"host"`` on CUDA and ``"disk"`` on CPU.

    ``directory`` is where ``"disk"`` makes its private directory (default: the system temp
    dir). ``bandwidth`` (bytes/s, both directions) replaces the measured link speed (how much of
    a copy hides behind compute still follows ``copy_overlap``): for planning
    on a machine other than the one that runs, and for tests that need a plan independent of
    timing. Values under ``min_bytes`` are never offloaded (four ops and a file per value cost
    more than the bytes they would free). ``host_budget`` (bytes or a size such as ``"8GiB"``)
    caps what one step may hold off the device, in host memory or on disk; plans respect it, and
    a device budget that cannot be met within it is refused before any step runs. Disk offload
    is also capped at 90% of the free space where its directory is, measured when a graph is
    planned.
    """

    to: str | None = None
    directory: str | None = None
    bandwidth: float | None = None
    min_bytes: int = 64 * 1024
    host_budget: int | str | None = None

    def __post_init__(self) -> None:
        if self.to is not None and self.to not in OFFLOAD_DESTINATIONS:
            raise ValueError(f"offload_to must be one of {OFFLOAD_DESTINATIONS}, got {self.to!r}")
        if self.bandwidth is not None and not self.bandwidth > 0:
            raise ValueError(f"offload_bandwidth must be positive bytes/s, got {self.bandwidth!r}")
        if isinstance(self.min_bytes, bool) or not isinstance(self.min_bytes, int):
            raise TypeError(f"min_bytes must be an int, got {self.min_bytes!r}")
        if self.min_bytes < 1:
            raise ValueError(f"min_bytes must be at least 1, got {self.min_bytes}")
        if self.directory is not None:
            check_directory(self.directory)
        if self.host_budget is not None:
            budget = parse_budget(self.host_budget)
            if budget.bytes is None:
                raise ValueError(
                    f"host_budget is an amount of memory (bytes or a size such as '8GiB'), "
                    f"not a fraction: got {self.host_budget!r}"
                )
            object.__setattr__(self, "host_budget", budget.bytes)

    @property
    def host_budget_bytes(self) -> int | None:
        assert self.host_budget is None or isinstance(self.host_budget, int)
        return self.host_budget

    def destination(self, device: torch.device) -> str:
        """The destination for values on ``device``; an error for host offload of CPU values."""
        to = self.to or ("host" if device.type == "cuda" else "disk")
        if to == "host" and device.type != "cuda":
            raise OffloadError(
                f"offload_to='host' moves activations from an accelerator to host memory, but this "
                f"model's activations are on {device.type!r}, already in host memory: use "
                f"offload_to='disk' (or leave offload_to unset)"
            )
        if to == "disk" and device.type not in ("cpu", "cuda"):
            raise OffloadError(f"offload to disk supports CPU and CUDA tensors, not {device.type}")
        return to


def check_directory(directory: str) -> None:
    """Fail now, before any step runs, if ``directory`` cannot hold offload files."""
    if not os.path.isdir(directory):
        raise OffloadError(f"offload_dir {directory!r} does not exist or is not a directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise OffloadError(f"offload_dir {directory!r} is not writable by this user")


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
        if to not in OFFLOAD_DESTINATIONS:
            raise ValueError(f"unknown offload destination {to!r}")
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
                    f"{self.directory}: {exc}; free disk space or pass offload_dir= on a larger "
                    f"disk (the step's offload files were removed)"
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


# ---- the custom ops --------------------------------------------------------------------------


@torch.library.custom_op("memfit::offload", mutates_args=())
def _offload(x: torch.Tensor, store: int) -> torch.Tensor:
    s = store_for(store)
    return _handle(s, s.offload(x), owns=False)


@_offload.register_fake
def _(x: torch.Tensor, store: int) -> torch.Tensor:
    return torch.empty((), dtype=torch.int64, device="cpu")


@torch.library.custom_op("memfit::offload_wait", mutates_args=())
def _offload_wait(x: torch.Tensor, handle: torch.Tensor, store: int) -> torch.Tensor:
    s = store_for(store)
    key = int(handle.item())
    s.wait_out(key)
    s.slots[key].owned = True
    return _handle(s, key, owns=True)


@_offload_wait.register_fake
def _(x: torch.Tensor, handle: torch.Tensor, store: int) -> torch.Tensor:
    return torch.empty((), dtype=torch.int64, device="cpu")


@torch.library.custom_op("memfit::reload_start", mutates_args=())
def _reload_start(handle: torch.Tensor, store: int) -> torch.Tensor:
    store_for(store).reload_start(int(handle.item()))
    return torch.empty((), dtype=torch.int64)


@_reload_start.register_fake
def _(handle: torch.Tensor, store: int) -> torch.Tensor:
    return torch.empty((), dtype=torch.int64, device="cpu")


@torch.library.custom_op("memfit::reload_wait", mutates_args=())
def _reload_wait(
    handle: torch.Tensor,
    token: torch.Tensor,
    store: int,
    size: list[int],
    stride: list[int],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    return store_for(store).reload_wait(int(handle.item()))


@_reload_wait.register_fake
def _(
    handle: torch.Tensor,
    token: torch.Tensor,
    store: int,
    size: list[int],
    stride: list[int],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    return torch.empty_strided(size, stride, dtype=dtype, device=device)


# ---- the graph rewrite -----------------------------------------------------------------------


def insert_transfers(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    transfers: list[tuple[str, str, str]],
    store: OffloadStore,
    *,
    num_fwd_outputs: int,
) -> None:
    """Put each ``(value, wait_after, prefetch_before)`` transfer into ``fw`` and ``bw``.

    ``fw`` returns the step's outputs then the values saved for backward, which ``bw`` receives as
    its leading placeholders in the same order; an offloaded value is swapped for its handle in
    both. Node names are the joint graph's, which the split keeps.
    """
    if not transfers:
        return
    fw_nodes = {n.name: n for n in fw.graph.nodes}
    # BatchNorm twins' items are replaced in the forward graph by items of the original op, which
    # remember the name the plan knows them by.
    fw_nodes.update({n.meta[JOINT_NAME]: n for n in fw.graph.nodes if JOINT_NAME in n.meta})
    fw_output = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
    outputs = list(fw_output.args[0])
    saved = outputs[num_fwd_outputs:]
    bw_placeholders = [n for n in bw.graph.nodes if n.op == "placeholder"]
    bw_nodes = {n.name: n for n in bw.graph.nodes}
    by_name = {n.name: n for n in bw_placeholders}
    fw_index = {n: i for i, n in enumerate(fw.graph.nodes)}  # the original nodes' order
    reloads = []
    for value_name, wait_after, prefetch_before in transfers:
        value = fw_nodes[value_name]
        position = next(i for i, s in enumerate(saved) if s is value)
        anchor = fw_nodes.get(wait_after, value)
        val = value.meta["val"]
        with _fake_mode_of(val):
            fake_handle = torch.empty((), dtype=torch.int64)
        with fw.graph.inserting_after(value):
            handle = fw.graph.call_function(torch.ops.memfit.offload.default, (value, store.id))
        handle.meta["val"] = fake_handle
        after = anchor if fw_index[anchor] > fw_index[value] else handle
        with fw.graph.inserting_after(after):
            done = fw.graph.call_function(
                torch.ops.memfit.offload_wait.default, (value, handle, store.id)
            )
        done.meta["val"] = fake_handle
        saved[position] = done

        # The backward receives the saved value under its joint-graph name (by position only
        # if the split ever renamed it).
        placeholder = by_name.get(value_name, bw_placeholders[position])
        readers = list(placeholder.users)
        placeholder.meta["val"] = fake_handle
        if readers:
            reloads.append((placeholder, readers, bw_nodes.get(prefetch_before), val, fake_handle))
    # Reloads start in the order the schedule issues them: by prefetch node, then by first
    # reader (the one queue reads them one after another, as the simulator assumes).
    order = _order_in(bw.graph)
    issued = []
    for placeholder, readers, prefetch, val, fake_handle in reloads:
        first = min(readers, key=order)
        if prefetch is None or order(prefetch) > order(first):
            prefetch = first
        issued.append(
            (order(prefetch), order(first), placeholder, readers, prefetch, first, val, fake_handle)
        )
    issued.sort(key=lambda item: (item[0], item[1]))
    for _, _, placeholder, readers, prefetch, first, val, fake_handle in issued:
        with bw.graph.inserting_before(prefetch):
            token = bw.graph.call_function(
                torch.ops.memfit.reload_start.default, (placeholder, store.id)
            )
        token.meta["val"] = fake_handle
        with bw.graph.inserting_before(first):
            reloaded = bw.graph.call_function(
                torch.ops.memfit.reload_wait.default,
                (
                    placeholder,
                    token,
                    store.id,
                    list(val.shape),
                    list(val.stride()),
                    val.dtype,
                    val.device,
                ),
            )
        reloaded.meta["val"] = val
        for r in readers:
            r.replace_input_with(placeholder, reloaded)
    fw_output.args = (tuple(outputs[:num_fwd_outputs]) + tuple(saved),)
    for gm in (fw, bw):
        gm.graph.lint()
        gm.recompile()


def _fake_mode_of(val: torch.Tensor) -> Any:
    mode = getattr(val, "fake_mode", None)
    return contextlib.nullcontext() if mode is None else mode


def _order_in(graph: fx.Graph) -> Callable[[fx.Node], int]:
    index = {n: i for i, n in enumerate(graph.nodes)}
    return index.__getitem__


# ---- the link --------------------------------------------------------------------------------


_LINKS: dict[tuple[str, str, str | None, int], Link] = {}


def measure_link(to: str, device: torch.device, directory: str | None = None) -> Link:
    """The link to ``to`` for values on ``device``, measured once per process and thread count.

    Bandwidth out and in (32 MiB round trips) and latency per copy (4 KiB round trips) are
    measured through the store itself (its threads, files or pinned arena), medians of three.
    ``overlap`` (the fraction of copying that hides behind compute) follows from where the copies
    run (``copy_overlap``).
    """
    key = (to, str(device), directory, torch.get_num_threads())
    if key in _LINKS:
        return _LINKS[key]
    store = OffloadStore(to, directory)
    try:
        big = torch.ones(32 * 2**20 // 4, dtype=torch.float32, device=device)
        small = torch.ones(1024, dtype=torch.float32, device=device)
        out_s, in_s = _round_trips(store, big, device)
        small_out, small_in = _round_trips(store, small, device)
        nbytes = big.numel() * big.element_size()
        latency = (small_out + small_in) / 2
        link = Link(
            out_bytes_per_s=nbytes / max(out_s - latency, 1e-9),
            in_bytes_per_s=nbytes / max(in_s - latency, 1e-9),
            latency_s=latency,
            overlap=copy_overlap(device),
        )
    finally:
        store.close()
    _LINKS[key] = link
    return link


def copy_overlap(device: torch.device) -> float:
    """The fraction of a copy's time that runs beside compute on ``device``.

    On CUDA the copies run on the copy engines, on side streams, beside the kernels: 1. On a CPU
    the store's threads copy on the same cores that compute: only the cores torch's intra-op
    threads leave idle can hide them. Measured on this project's 2-core machine (ResNet, 92 MiB
    offloaded per step to disk): with 2 torch threads a step took 1.65x plain and its copies hid
    behind nothing; with 1 thread, 1.18x. Trying to measure the overlap directly (copies beside a
    matrix-product loop) gave anything from 0.06 to 0.92 from run to run on that machine, so the
    rule is used instead of a number that noisy.
    """
    if device.type == "cuda":
        return 1.0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(0.0, 1.0 - torch.get_num_threads() / max(cores or 1, 1))


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def _round_trips(store: OffloadStore, x: torch.Tensor, device: torch.device) -> tuple[float, float]:
    outs, ins = [], []
    keys: list[int] = []

    def out() -> None:
        keys.append(store.offload(x))
        store.wait_out(keys[-1])

    def back() -> None:
        store.reload_wait(keys[-1])

    for _ in range(3):
        outs.append(_timed(out, device))
        ins.append(_timed(back, device))
    return sorted(outs)[1], sorted(ins)[1]
