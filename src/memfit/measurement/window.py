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
next call). So on CPU a window asks a running memfit recording (a ``memfit.measure`` around the
step) for the window's peak, delivered when that recording ends; or, where the caller asks for it
(``record=True``: a budget that must cover the loss), it starts a recording of its own when the
forward returns and ends it at the first safe point after the backward: the next memfit call
starts (before anything is compiled), an optimizer steps (``register_optimizer_step_pre_hook``,
which every optimizer runs, inside Trainer, accelerate and Lightning too), a ``memfit.measure``
begins, or the process exits (``MemoryWindow.settle``). A recording of its own is one profiler
session over one step's loss, backward and optimizer step, once per capture. While it runs a
profiler the user starts would share the session (torch does not refuse the second one), so it
starts only where no profiler runs, and only where asked.
"""

from __future__ import annotations

import atexit
import time
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from memfit.measurement.cpu import CpuRecording, cpu_recording_blocked
from memfit.measurement.cuda import CudaRecording

__all__ = ["MemoryLevels", "MemoryWindow"]


class MemoryWindow:
    """Tensor memory on one device from ``open`` to ``close``; see the module docstring."""

    #: the CPU recording windows started themselves, running until ``settle``
    _own: ClassVar[CpuRecording | None] = None
    _settle_on_step: ClassVar[RemovableHandle | None] = None
    _settle_at_exit: ClassVar[bool] = False

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
    def can_open(record: bool = False) -> bool:
        """Whether a window could open on some device now: a CPU recording is running (or, with
        ``record``, one could start), or CUDA is initialized (no CUDA tensor exists before it
        is). A caller asks this first, before it looks for the device of a step's outputs."""
        if CpuRecording.current is not None or torch.cuda.is_initialized():
            return True
        return record and cpu_recording_blocked() is None

    @classmethod
    def open(
        cls,
        device: torch.device,
        deliver: Callable[[int], None],
        *,
        record: bool = False,
        watch: Iterable[torch.Tensor] = (),
    ) -> MemoryWindow | None:
        """A window opened now on ``device`` that will ``deliver`` its peak, or None when it
        cannot open (CPU with no memfit recording running, and none of its own asked for or
        possible: another profiler runs, or a compile is under way).

        ``record``: on CPU with no recording running, start one of the window's own, ended by
        ``settle``; call only where a profiler session may start (not inside the autograd
        engine or a compile). ``watch``: tensors alive now whose frees the window should see
        (the step's outputs, which the caller may drop before its backward)."""
        if device.type == "cuda":
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            recording = CudaRecording(device)
            recording.__enter__()
            return cls(deliver, cuda=recording)
        if device.type != "cpu":
            return None
        host = CpuRecording.current
        if host is None and record:
            host = cls._record(watch)
        return cls(deliver, host=host) if host is not None else None

    @classmethod
    def _record(cls, watch: Iterable[torch.Tensor]) -> CpuRecording | None:
        """Start the windows' own CPU recording, or None where none may start now."""
        if cpu_recording_blocked() is not None or torch.compiler.is_compiling():
            return None
        recording = CpuRecording(watch)
        recording.__enter__()
        cls._own = recording
        cls._settle_on_step = register_optimizer_step_pre_hook(_settle_before_step)
        if not cls._settle_at_exit:
            atexit.register(cls.settle)
            cls._settle_at_exit = True
        return recording

    @classmethod
    def settle(cls) -> None:
        """End the windows' own CPU recording if one runs: each window closed in it delivers
        its peak now. Called where a profiler session may stop: the start of a memfit call,
        an optimizer's step, a ``memfit.measure`` beginning, the process exiting."""
        recording, cls._own = cls._own, None
        handle, cls._settle_on_step = cls._settle_on_step, None
        if handle is not None:
            handle.remove()
        if recording is not None:
            recording.__exit__(None, None, None)

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


def _settle_before_step(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
    """An optimizer steps: the backward of the step a window watched is over."""
    MemoryWindow.settle()
