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

from memfit.execution.offload.link import (
    copy_overlap,
    measure_link,
)
from memfit.execution.offload.offload_options import (
    OffloadError,
    OffloadOptions,
    OffloadTarget,
    check_directory,
)
from memfit.execution.offload.offloader import Offloader
from memfit.execution.offload.rewrite import (
    JOINT_NAME,
    insert_transfers,
)
from memfit.execution.offload.store import (
    Arena,
    OffloadStore,
    store_for,
)

__all__ = [
    "JOINT_NAME",
    "Arena",
    "OffloadTarget",
    "check_directory",
    "OffloadError",
    "Offloader",
    "OffloadOptions",
    "OffloadStore",
    "insert_transfers",
    "copy_overlap",
    "measure_link",
    "store_for",
]
