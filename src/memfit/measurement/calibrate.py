"""The peaks of a compiled forward and backward graph, measured once on the step's own inputs.

Why measure instead of predicting: with ``executor="inductor"`` the graphs memfit planned run as
kernels Inductor generated, with buffers Inductor allocates, orders and frees itself; neither the
op-by-op simulation nor Inductor's own buffer-lifetime estimate matched what ran (measured on a
transformer encoder, CPU: the step peaked at 1.30x the simulation and 1.38x the estimate, with
extern kernels' workspaces and Inductor's codegen holding more than either models). Running the
two compiled graphs once (on CUDA twice, measured the second time: ``_warm_up``), as the step
will (the forward on the parameters and inputs of the call being captured, the backward on what
it saved and gradients of ones), and reading the allocator gives the peaks the step will have,
by construction: a calibration per graph, paid once, while the graph is planned and before the
user's step runs.

Nothing the call sees changes: the graphs are functional (AOTAutograd applies BatchNorm's
running-statistic updates after the compiled forward returns, and here nothing applies them),
no gradient reaches a ``.grad``, and the random-number generators are restored afterwards, so
dropout masks stay plain PyTorch's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from memfit.measurement.cpu import CpuRecording, cpu_recording_blocked
from memfit.measurement.cuda import CudaRecording
from memfit.measurement.timing import cuda_index, inputs_device
from memfit.measurement.window import MemoryWindow

__all__ = ["StepPeaks", "measure_compiled_step"]


@dataclass(frozen=True)
class StepPeaks:
    """Bytes above what was alive before the forward ran (parameters and inputs not counted)."""

    forward_peak_bytes: int
    #: alive when the forward returned: its outputs and what it saved for backward
    forward_end_bytes: int
    backward_peak_bytes: int


def measure_compiled_step(
    forward: Callable[[list[Any]], Any],
    backward: Callable[[list[Any]], Any],
    inputs: Sequence[Any],
    backward_inputs: Callable[[Sequence[Any]], list[Any]],
    user_outputs: int,
) -> StepPeaks | None:
    """Run ``forward`` on ``inputs`` and ``backward`` on ``backward_inputs(its outputs)``, both
    boxed, and measure each; None where memory cannot be recorded now (on CPU, while another
    profiler session runs, as a ``memfit.measure`` around the first step is).

    The forward's first ``user_outputs`` outputs are held while the backward runs (the user's
    code holds them), the rest only by the backward's argument list, which it clears: each saved
    value is freed after its last reader, as in the step.
    """
    device = inputs_device(inputs)
    if device is not None and device.type == "cpu":
        MemoryWindow.settle()  # a window's own recording gives way, as to memfit.measure
    if device is None or (device.type == "cpu" and cpu_recording_blocked() is not None):
        return None
    if device.type not in ("cpu", "cuda"):
        return None
    cuda: list[int] = []
    if device.type == "cuda":
        cuda = [cuda_index(device)]
    with torch.random.fork_rng(devices=cuda), torch.no_grad():
        if cuda:
            _warm_up(forward, backward, inputs, backward_inputs)
        watched = [t for t in inputs if isinstance(t, torch.Tensor)]
        with _recording(device, watched) as forward_memory:
            outputs = forward(list(inputs))
        forward_peak, forward_end = forward_memory.result()
        args = backward_inputs(outputs)
        held = list(outputs[:user_outputs])
        del outputs
        # alive as the backward starts: what it reads (saved values, tangents) and what the
        # user's code holds, less the parameters and inputs
        entry = _new_bytes([*args, *held], watched)
        # The recording watches the saved values through weak references only: a list of them
        # here would keep each alive past its last reader.
        with _recording(device, (t for t in args if isinstance(t, torch.Tensor))) as memory:
            grads = backward(args)
        backward_peak, _ = memory.result()
        del grads, held
    return StepPeaks(forward_peak, forward_end, entry + backward_peak)


def _warm_up(
    forward: Callable[[list[Any]], Any],
    backward: Callable[[list[Any]], Any],
    inputs: Sequence[Any],
    backward_inputs: Callable[[Sequence[Any]], list[Any]],
) -> None:
    """On CUDA, one unmeasured run first: the first call of a compiled Triton kernel with several
    configurations benchmarks each of them on copies of the buffers it writes, and a process's
    first matmul allocates cuBLAS's workspace, which the step then keeps; a step repeats neither.
    Measured on an H200 (the frontier's transformer, 2026-11-26), the first two plans compiled in
    a process were predicted 1.12x and 1.29x their measured peaks, and the second of them, compiled
    again later in the same process (its kernels tuned), 1.03x."""
    outputs = forward(list(inputs))
    args = backward_inputs(outputs)
    del outputs
    grads = backward(args)
    del grads, args


def _new_bytes(args: Sequence[Any], *existing: Sequence[Any]) -> int:
    """Bytes of the distinct storages among ``args`` that none of ``existing`` has."""
    seen = {
        t.untyped_storage().data_ptr()
        for group in existing
        for t in group
        if isinstance(t, torch.Tensor)
    }
    total = 0
    for t in args:
        if isinstance(t, torch.Tensor):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                total += t.untyped_storage().nbytes()
    return total


class _recording:
    """One measured stretch on ``device``: peak and end bytes above its start."""

    def __init__(self, device: torch.device, watch: Iterable[torch.Tensor]) -> None:
        self._device = device
        self._watch = watch
        self._cpu: CpuRecording | None = None
        self._cuda: CudaRecording | None = None

    def __enter__(self) -> _recording:
        if self._device.type == "cuda":
            self._cuda = CudaRecording(torch.device("cuda", cuda_index(self._device)))
            self._cuda.__enter__()
        else:
            self._cpu = CpuRecording(iter(self._watch))
            self._cpu.__enter__()
        self._watch = ()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._cuda is not None:
            self._cuda.__exit__(*exc)
        elif self._cpu is not None:
            self._cpu.__exit__(*exc)

    def result(self) -> tuple[int, int]:
        if self._cuda is not None:
            return self._cuda.peak_bytes, self._cuda.end_bytes
        assert self._cpu is not None
        memory = self._cpu.memory()
        return memory.peak_bytes, memory.end_bytes
