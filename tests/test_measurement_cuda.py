"""Tests for memfit.measurement.cuda: CUDA tensor memory from allocator counters, nesting."""

from __future__ import annotations

import functools

import pytest
import torch

from conftest import CUDA
from measuring import kept_intermediates, mlp_step, small_mlp
from memfit.measurement import measure
from memfit.measurement.cuda import CudaRecording


def test_recording_needs_a_cuda_device_with_an_index():
    for bad in (torch.device("cpu"), torch.device("cuda")):
        with pytest.raises(ValueError, match="CUDA device with an index") as info:
            CudaRecording(bad)
        assert repr(bad) in str(info.value)


# The caching allocator rounds blocks up to 512 bytes; sizes here are multiples of it.
CUDA_MB = 1 << 20
CUDA_FLOATS_PER_MB = CUDA_MB // 4


@CUDA
def test_cuda_allocation_kept_is_exact():
    m = measure(lambda: torch.empty(CUDA_FLOATS_PER_MB, device="cuda"), device="cuda")
    assert m.peak_bytes == m.end_bytes == CUDA_MB
    assert m.device == f"cuda:{torch.cuda.current_device()}"
    assert m.timeline == [(0.0, 0), (m.time_s, CUDA_MB)]


@CUDA
def test_cuda_sequential_and_concurrent_peaks():
    def sequential():
        a = torch.empty(CUDA_FLOATS_PER_MB, device="cuda")
        del a
        b = torch.empty(CUDA_FLOATS_PER_MB, device="cuda")
        del b

    def concurrent():
        a = torch.empty(CUDA_FLOATS_PER_MB, device="cuda")
        b = torch.empty(CUDA_FLOATS_PER_MB, device="cuda")
        del a, b

    seq = measure(sequential, device="cuda")
    con = measure(concurrent, device="cuda")
    assert (seq.peak_bytes, seq.end_bytes) == (CUDA_MB, 0)
    assert (con.peak_bytes, con.end_bytes) == (2 * CUDA_MB, 0)


@CUDA
def test_cuda_preexisting_tensor_freed_is_negative():
    holder = [torch.empty(CUDA_FLOATS_PER_MB, device="cuda")]
    m = measure(holder.clear)  # inferred from the tensor in the closure
    assert m.device.startswith("cuda:")
    assert m.end_bytes == -CUDA_MB
    assert m.peak_bytes == 0


@CUDA
def test_cuda_device_inferred_from_args_and_modules():
    model = small_mlp("cuda")
    x = torch.randn(64, 256, device="cuda")
    m = measure(mlp_step, model, x)
    assert m.device == f"cuda:{x.device.index}"
    assert m.peak_bytes > 0
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    assert m.end_bytes >= grads
    assert measure(functools.partial(mlp_step, model), x=x).device.startswith("cuda:")
    assert measure(lambda d: d["x"].sum(), {"x": x}).device.startswith("cuda:")


@CUDA
def test_cuda_kept_intermediates_peak_at_least_their_sum():
    x = torch.randn(CUDA_FLOATS_PER_MB, device="cuda")
    m = measure(kept_intermediates, x, 5)
    assert m.peak_bytes >= 5 * CUDA_MB
    assert m.end_bytes == 5 * CUDA_MB


@CUDA
def test_cuda_nested_measure_keeps_outer_peak():
    def outer():
        a = torch.empty(2 * CUDA_FLOATS_PER_MB, device="cuda")
        del a  # outer peak so far: 2 MB, then the inner call resets the peak counter
        inner = measure(lambda: torch.empty(CUDA_FLOATS_PER_MB, device="cuda"), device="cuda")
        return inner

    m = measure(outer, device="cuda")
    assert m.result.peak_bytes == CUDA_MB
    assert m.peak_bytes == 2 * CUDA_MB
    assert m.end_bytes == CUDA_MB


@CUDA
def test_cuda_cpu_measurement_ignores_cuda_memory():
    m = measure(lambda: torch.empty(CUDA_FLOATS_PER_MB, device="cuda"), device="cpu")
    assert m.peak_bytes < CUDA_MB  # only host-side bookkeeping, if any


@CUDA
def test_cuda_bad_index_raises_value_error():
    bad = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(ValueError, match="does not exist"):
        measure(lambda: None, device=bad)


@CUDA
def test_cuda_recordings_nest_directly():
    dev = torch.device("cuda", torch.cuda.current_device())
    with CudaRecording(dev) as outer:
        a = torch.empty(2 * CUDA_FLOATS_PER_MB, device=dev)
        del a
        with CudaRecording(dev) as inner:
            kept = torch.empty(CUDA_FLOATS_PER_MB, device=dev)
    assert (inner.peak_bytes, inner.end_bytes) == (CUDA_MB, CUDA_MB)
    assert (outer.peak_bytes, outer.end_bytes) == (2 * CUDA_MB, CUDA_MB)
    del kept
