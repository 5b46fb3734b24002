"""``measurement.calibrate``: a compiled forward and backward run once and measured, with the
saved values freed after their last reader and the user's outputs held, as in the step."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from conftest import CUDA
from memfit.measurement.calibrate import StepPeaks, measure_compiled_step

N = 1 << 14  # floats: 64 KiB per tensor
B = 4 * N
#: the allocator also sees a few bytes of torch's own bookkeeping around the calls
SLACK = 1024


def _about(measured: int, expected: int) -> bool:
    return expected <= measured <= expected + SLACK


def _forward(args: list[Any]) -> list[torch.Tensor]:
    (x,) = args
    args.clear()
    scratch = torch.ones(4 * N)  # 4B, freed before the forward ends
    del scratch
    a = x * 2  # saved for backward
    b = a + 1  # the user's output
    return [b, a]


def _backward(args: list[Any]) -> list[torch.Tensor]:
    a, g = args
    args.clear()
    t = g * a
    del a, g  # the saved value and the tangent die here
    return [t * 3]


def _backward_inputs(outputs: Any) -> list[Any]:
    return [outputs[1], torch.ones(N)]


def test_peaks_of_forward_and_backward_above_the_step_entry() -> None:
    x = torch.randn(N)
    peaks = measure_compiled_step(_forward, _backward, [x], _backward_inputs, user_outputs=1)
    # forward: the scratch (4B) is its peak; a and b (2B) alive at its end. Backward: a, b and
    # the tangent (3B) at its start, t makes 4B, then a and the tangent die (2B), the result 3B.
    assert isinstance(peaks, StepPeaks)
    assert _about(peaks.forward_peak_bytes, 4 * B)
    assert _about(peaks.forward_end_bytes, 2 * B)
    assert _about(peaks.backward_peak_bytes, 4 * B)


def test_saved_values_held_elsewhere_would_show() -> None:
    """The measurement sees a saved value's free: kept alive outside, the backward peaks higher."""
    x = torch.randn(N)
    kept: list[torch.Tensor] = []

    def keeping(outputs: Any) -> list[Any]:
        kept.append(outputs[1])
        return _backward_inputs(outputs)

    # with the saved value alive throughout, the result comes on top of a, b and t
    def backward_keeping_t(args: list[Any]) -> list[torch.Tensor]:
        a, g = args
        args.clear()
        t = g * a
        del g
        return [t * 3 + a]

    peaks = measure_compiled_step(_forward, backward_keeping_t, [x], keeping, user_outputs=1)
    assert peaks is not None and peaks.backward_peak_bytes >= 5 * B


def test_no_measurement_while_a_profiler_runs() -> None:
    x = torch.randn(N)
    with torch.profiler.profile():
        assert measure_compiled_step(_forward, _backward, [x], _backward_inputs, 1) is None


def test_random_state_is_left_as_it_was() -> None:
    x = torch.randn(N)

    def drawing(args: list[Any]) -> list[torch.Tensor]:
        out = _forward(args)
        torch.rand(3)
        return out

    torch.manual_seed(5)
    measure_compiled_step(drawing, _backward, [x], _backward_inputs, user_outputs=1)
    after = torch.rand(4)
    torch.manual_seed(5)
    assert torch.equal(after, torch.rand(4))


@pytest.mark.parametrize("user_outputs", [0, 1])
def test_user_outputs_are_held_through_the_backward(user_outputs: int) -> None:
    x = torch.randn(N)
    peaks = measure_compiled_step(_forward, _backward, [x], _backward_inputs, user_outputs)
    assert peaks is not None
    # with the output b not held, it dies before the backward: one tensor less at its peak
    assert _about(peaks.backward_peak_bytes, (4 if user_outputs else 3) * B)


@CUDA
def test_cuda_first_call_allocations_are_not_the_steps() -> None:
    """On CUDA a compiled pair's first call allocates what later calls do not (Triton's autotuning
    copies, cuBLAS's workspace): measured, it made an H200's first plans 1.12-1.29x their
    step's peak. Here the forward's first call keeps a 16B buffer for good; the peaks are the
    steady step's, as on CPU, where first calls allocate nothing of the kind."""
    first_call: list[torch.Tensor] = []
    x = torch.randn(N, device="cuda")

    def forward(args: list[Any]) -> list[torch.Tensor]:
        if not first_call:
            first_call.append(torch.empty(16 * N, device="cuda"))
        (x,) = args
        args.clear()
        scratch = torch.ones(4 * N, device="cuda")
        del scratch
        a = x * 2
        return [a + 1, a]

    def backward_inputs(outputs: Any) -> list[Any]:
        return [outputs[1], torch.ones(N, device="cuda")]

    peaks = measure_compiled_step(forward, _backward, [x], backward_inputs, user_outputs=1)
    assert peaks is not None and first_call
    assert _about(peaks.forward_peak_bytes, 4 * B)  # not 16B more
    assert _about(peaks.backward_peak_bytes, 4 * B)
