"""CUDA tensor memory, read from the caching allocator's own counters.

On CUDA the caching allocator keeps exact counters, so no profiler is needed:
``torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(dev); base =
torch.cuda.memory_allocated(dev)``, run, synchronize, and ``peak = max_memory_allocated(dev) -
base``, ``end = memory_allocated(dev) - base``. These count bytes *allocated to tensors* (each
block rounded up to the allocator's 512-byte granularity), not the *reserved* cache the allocator
keeps from the driver, and not the CUDA context, cuBLAS/cuDNN handles or NCCL buffers. Reserved
memory is a property of the process's history, not of the call. Timing is clean on CUDA: the
counters cost nothing.

There is no full timeline on CUDA, only its two end points. A full one would need
``torch.cuda.memory._record_memory_history``, which we do not use: it is process-global state that
we could not restore (there is no getter, so a user's own recording would be clobbered), and
``_snapshot()`` serialises the whole ring buffer and every segment, which is not cheap.

NOTE [Nested CUDA recordings fold their peaks outward]
    The peak counter is one per device, and a recording must reset it, which would erase the peak
    an enclosing recording has seen so far. So every open recording keeps a frame: before a
    recording resets the counter it folds the current peak into the frames of every enclosing
    recording on that device, and when it ends it folds its own peak into them too. An enclosing
    recording's peak is the largest of its frame and the counter when it ends. Every user of the
    peak counter in memfit goes through :class:`CudaRecording`; a ``reset_peak_memory_stats`` made
    elsewhere still breaks enclosing recordings.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType

import torch

__all__ = ["CudaRecording"]


@dataclass
class _Frame:
    index: int
    peak_abs: int  # highest memory_allocated() seen so far, absolute


# Frames of the open recordings, outermost first; see NOTE [Nested CUDA recordings ...].
_frames: list[_Frame] = []


def _fold(index: int, peak_abs: int) -> None:
    for frame in _frames:
        if frame.index == index:
            frame.peak_abs = max(frame.peak_abs, peak_abs)


class CudaRecording:
    """Records one CUDA device's tensor memory from ``__enter__`` to ``__exit__``; nests.

    The device is synchronised on entry and exit, so work queued inside counts. After exit,
    ``peak_bytes`` (never below 0) and ``end_bytes`` (negative when more was freed than kept) are
    bytes above what was allocated on entry.

    Args:
        device: a CUDA device with an index (``torch.device("cuda", 0)``).

    Raises:
        ValueError: ``device`` is not a CUDA device with an index.
    """

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda" or device.index is None:
            raise ValueError(
                f"CudaRecording needs a CUDA device with an index, like torch.device('cuda', 0); "
                f"got {device!r}."
            )
        self.index: int = device.index
        self.peak_bytes = 0
        self.end_bytes = 0
        self._frame: _Frame | None = None
        self._base = 0

    def __enter__(self) -> CudaRecording:
        index = self.index
        torch.cuda.synchronize(index)
        _fold(index, torch.cuda.max_memory_allocated(index))
        torch.cuda.reset_peak_memory_stats(index)
        self._base = torch.cuda.memory_allocated(index)
        self._frame = _Frame(index, self._base)
        _frames.append(self._frame)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        index, frame = self.index, self._frame
        assert frame is not None, "CudaRecording.__exit__ without __enter__"
        try:
            torch.cuda.synchronize(index)
            peak_abs = max(frame.peak_abs, torch.cuda.max_memory_allocated(index))
            end = torch.cuda.memory_allocated(index) - self._base
        finally:
            _frames.remove(frame)
        _fold(index, peak_abs)  # let enclosing recordings see this peak, though we reset it
        self.end_bytes = end
        self.peak_bytes = max(0, peak_abs - self._base, end)
