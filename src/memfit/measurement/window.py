"""The peak tensor memory of code memfit does not run: from one of its calls to a later one.

A model wrapped alone (``memfit.checkpoint(model)``) returns its outputs to the user's code, which
computes a loss and starts the backward; what that code allocates in between (a log-softmax over
a vocabulary, its gradient) sits on top of everything the forward left alive, and no captured
graph sees it. A ``MemoryWindow`` opens when the wrapper's forward returns and closes when its
backward graph starts, and delivers the peak of that stretch, bytes above its start.

On CUDA it reads the allocator's counters (``CudaRecording``, which nests), so a window opens on
any step. On CPU memory can only be counted by a profiler session, and a window cannot run one
of its own: it would have to stop where it closes, inside the autograd engine, and the engine
restores the thread's state after each node, profiler state included, so a session stopped there
comes back half alive (checked on torch 2.13: the profiler still reported itself enabled on the
next call, and a session left running until a later call broke a user's own profiler). So on CPU
a window opens only inside a memfit recording (a ``memfit.measure`` around the step) and asks it
for the window's peak, delivered when that recording ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from memfit.measurement.cpu import CpuRecording
from memfit.measurement.cuda import CudaRecording

__all__ = ["MemoryLevels", "MemoryWindow"]


class MemoryWindow:
    """Tensor memory on one device from ``open`` to ``close``; see the module docstring."""

    def __init__(
        self,
        deliver: Callable[[int], None],
        cuda: CudaRecording | None = None,
        host: CpuRecording | None = None,
    ) -> None:
        self._deliver = deliver
        self._cuda = cuda  # a CUDA recording of the window's own
        self._host = host  # or the running CPU recording to ask
        self._start_ns = time.time_ns()
        self.is_open = True

    @staticmethod
    def can_open() -> bool:
        """Whether a window could open on some device now: a CPU recording is running, or CUDA
        is initialized (no CUDA tensor exists before it is). A caller asks this first, before
        it looks for the device of a step's outputs, on every step."""
        return CpuRecording.current is not None or torch.cuda.is_initialized()

    @classmethod
    def open(cls, device: torch.device, deliver: Callable[[int], None]) -> MemoryWindow | None:
        """A window opened now on ``device`` that will ``deliver`` its peak, or None when it
        cannot open (CPU with no memfit recording running)."""
        if device.type == "cuda":
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            recording = CudaRecording(device)
            recording.__enter__()
            return cls(deliver, cuda=recording)
        host = CpuRecording.current if device.type == "cpu" else None
        return cls(deliver, host=host) if host is not None else None

    def close(self) -> None:
        """The stretch watched ends now (safe anywhere, the autograd engine included): the
        peak is delivered now (CUDA) or when the recording it asked ends (CPU)."""
        if not self.is_open:
            return
        self.is_open = False
        if self._host is not None:
            self._host.request_window(self._start_ns, time.time_ns(), self._deliver)
        elif self._cuda is not None:
            self._cuda.__exit__(None, None, None)
            self._deliver(self._cuda.peak_bytes)

    def abandon(self) -> None:
        """End without a result (the code it watched ended some other way)."""
        if self.is_open and self._cuda is not None:
            self._cuda.__exit__(None, None, None)
        self.is_open = False


class MemoryLevels:
    """Tensor bytes live on one device at points a caller marks, above the first mark.

    Why: with graph breaks, the model's own Python runs between memfit's graphs, and what it
    keeps alive (tensors eager autograd saves for its own backward, SpecAugment's masks, a
    graph's outputs it still holds) sits under every later graph's forward and backward; no graph
    sees it. Marking the call's start and each graph's start gives what the step held there.
    On CUDA each mark reads the allocator's counter; on CPU, as a window, it asks the running
    memfit recording, which delivers the levels when it ends (no recording: no levels).
    """

    def __init__(
        self,
        deliver: Callable[[list[int]], None],
        device: torch.device | None = None,
        host: CpuRecording | None = None,
    ) -> None:
        self._deliver = deliver
        self._device = device  # CUDA: read at each mark
        self._host = host  # CPU: the running recording to ask
        self._marks: list[int] = []
        self.is_open = True
        self.mark()

    @classmethod
    def open(
        cls, device: torch.device, deliver: Callable[[list[int]], None]
    ) -> MemoryLevels | None:
        """Levels on ``device`` marked from now (the first mark), or None where they cannot be
        measured (CPU with no memfit recording running)."""
        if device.type == "cuda":
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            return cls(deliver, device=device)
        host = CpuRecording.current if device.type == "cpu" else None
        return cls(deliver, host=host) if host is not None else None

    def mark(self) -> None:
        """One more point to know the level at: now."""
        if not self.is_open:
            return
        if self._device is not None:
            self._marks.append(torch.cuda.memory_allocated(self._device))
        else:
            self._marks.append(time.time_ns())

    def close(self) -> None:
        """No more marks: the levels are delivered now (CUDA) or when the recording ends
        (CPU)."""
        if not self.is_open:
            return
        self.is_open = False
        if self._host is not None:
            self._host.request_levels(self._marks, self._deliver)
        else:
            self._deliver([m - self._marks[0] for m in self._marks])

    def abandon(self) -> None:
        """End without a result."""
        self.is_open = False
