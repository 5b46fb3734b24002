"""Tests for memfit.measurement.measure: exact tensor-memory accounting on CPU and CUDA."""

from __future__ import annotations

import dataclasses
import functools
import sys
import time

import pytest
import torch

from memfit.measurement import Measurement, measure

MB = 1_000_000
FLOATS_PER_MB = MB // 4

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")


def _kept_intermediates(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    """A forward that keeps n intermediate tensors, each the size of x."""
    kept = []
    h = x
    for _ in range(n):
        h = torch.tanh(h)
        kept.append(h)
    return kept


def _mlp_step(model: torch.nn.Module, x: torch.Tensor) -> None:
    model(x).square().mean().backward()


def _small_mlp(device: str = "cpu") -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)
    ).to(device)


# --------------------------------------------------------------------------- CPU accounting


def test_cpu_allocation_kept_is_exact():
    m = measure(lambda: torch.empty(1_000_000, dtype=torch.float32))
    # The CPU allocator reports the requested size; no alignment padding is counted.
    assert m.peak_bytes == m.end_bytes == 4_000_000
    assert m.device == "cpu"
    assert isinstance(m.result, torch.Tensor) and m.result.numel() == 1_000_000


def test_cpu_sequential_frees_peak_at_one_tensor():
    def sequential():
        a = torch.empty(FLOATS_PER_MB)
        del a
        b = torch.empty(FLOATS_PER_MB)
        del b

    m = measure(sequential)
    assert m.peak_bytes == MB
    assert m.end_bytes == 0


def test_cpu_concurrent_tensors_peak_at_both():
    def concurrent():
        a = torch.empty(FLOATS_PER_MB)
        b = torch.empty(FLOATS_PER_MB)
        del a, b

    m = measure(concurrent)
    assert m.peak_bytes == 2 * MB
    assert m.end_bytes == 0


def test_cpu_preexisting_tensor_freed_in_closure_is_negative():
    holder = [torch.empty(FLOATS_PER_MB)]
    m = measure(holder.clear)
    assert m.end_bytes == -MB
    assert m.peak_bytes == 0
    assert holder == []


def test_cpu_preexisting_tensor_freed_via_argument_is_negative():
    def drop_all(tensors: list[torch.Tensor]) -> None:
        tensors.clear()

    tensors = [torch.empty(FLOATS_PER_MB), torch.empty(FLOATS_PER_MB)]
    m = measure(drop_all, tensors)
    assert m.end_bytes == -2 * MB
    assert m.peak_bytes == 0


def test_cpu_free_then_allocate_peak_is_relative_to_entry():
    holder = [torch.empty(FLOATS_PER_MB)]

    def swap():
        holder.clear()  # -1 MB
        return torch.empty(2 * FLOATS_PER_MB)  # +2 MB: peak is +1 MB above entry

    m = measure(swap)
    assert m.end_bytes == MB
    assert m.peak_bytes == MB


def test_cpu_view_keeps_preexisting_storage_alive():
    base = torch.empty(FLOATS_PER_MB)
    holder = [base, base[10:]]
    del base

    m = measure(lambda: holder.pop(0))  # the view still holds the storage
    assert m.end_bytes == 0
    assert m.peak_bytes == 0


def test_cpu_preexisting_tensor_from_earlier_measure_is_not_counted_twice():
    # Blocks allocated while an earlier measure() was profiling are known to the
    # allocator, so the profiler reports their free too; it must be counted once.
    first = measure(lambda: torch.empty(FLOATS_PER_MB))
    holder = [first.result]
    first = None
    m = measure(holder.clear)
    assert m.end_bytes == -MB
    assert m.peak_bytes == 0


def test_cpu_parameter_replaced_inside_module():
    model = torch.nn.Linear(500, 500, bias=False)  # 1 MB weight

    def reset():
        model.weight = torch.nn.Parameter(torch.zeros(500, 500))

    m = measure(reset)
    assert m.end_bytes == 0  # +1 MB new weight, -1 MB old weight
    assert m.peak_bytes == MB  # both live for a moment


def test_cpu_kept_intermediates_peak_at_least_their_sum():
    x = torch.randn(FLOATS_PER_MB)
    n = 5
    m = measure(_kept_intermediates, x, n)
    assert m.peak_bytes >= n * MB
    assert m.end_bytes == n * MB


def test_cpu_autograd_saved_tensors_are_counted():
    x = torch.randn(FLOATS_PER_MB, requires_grad=True)
    n = 4

    def forward():
        return _kept_intermediates(x, n)[-1].sum()

    m = measure(forward)
    # tanh saves its output for backward: n tensors of 1 MB stay alive with the graph.
    assert m.peak_bytes >= n * MB
    assert m.end_bytes >= n * MB


def test_cpu_mlp_forward_backward():
    torch.manual_seed(0)
    model = _small_mlp()
    x = torch.randn(64, 256)
    m = measure(_mlp_step, model, x)
    assert m.peak_bytes > 0
    # The first backward allocates .grad for every parameter, and they stay.
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    assert m.end_bytes >= grads
    assert m.peak_bytes >= m.end_bytes


def test_cpu_timeline_is_consistent():
    def work():
        a = torch.empty(FLOATS_PER_MB)
        b = torch.empty(2 * FLOATS_PER_MB)
        del a
        return b

    m = measure(work)
    times = [t for t, _ in m.timeline]
    values = [v for _, v in m.timeline]
    assert m.timeline[0] == (0.0, 0)
    assert times == sorted(times)
    assert all(0.0 <= t <= m.time_s for t in times)
    assert max(values) == m.peak_bytes == 3 * MB
    assert values[-1] == m.end_bytes == 2 * MB


def test_cpu_profile_memory_false_measures_time_only():
    m = measure(lambda: torch.empty(FLOATS_PER_MB), profile_memory=False)
    assert m.peak_bytes is None and m.end_bytes is None
    assert m.timeline == []
    assert m.time_s >= 0
    assert "memory not measured" in str(m)


def test_time_is_wall_time():
    m = measure(time.sleep, 0.05)
    assert 0.05 <= m.time_s < 1.0


def test_fn_runs_exactly_once_with_args_and_kwargs():
    calls = []

    def fn(a, b, *, c):
        calls.append((a, b, c))
        return a + b + c

    m = measure(fn, 1, 2, c=3)
    assert calls == [(1, 2, 3)]
    assert m.result == 6


def test_fn_may_take_a_keyword_named_fn():
    m = measure(lambda fn: fn * 2, fn=21)
    assert m.result == 42


def test_exception_propagates_and_profiler_is_stopped():
    def boom():
        torch.empty(FLOATS_PER_MB)
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        measure(boom)
    # The profiler must not be left running: a second measurement works.
    assert measure(lambda: torch.empty(FLOATS_PER_MB)).peak_bytes == MB


def test_nested_cpu_measure_refuses():
    with pytest.raises(RuntimeError, match="another torch profiler"):
        measure(lambda: measure(lambda: torch.empty(10)))
    # ...and time-only nesting is fine.
    outer = measure(lambda: measure(lambda: torch.empty(FLOATS_PER_MB), profile_memory=False))
    assert outer.peak_bytes == MB


def test_measurement_is_frozen_and_readable():
    m = measure(lambda: torch.empty(FLOATS_PER_MB))
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.peak_bytes = 0  # type: ignore[misc]
    text = str(m)
    assert text.startswith("peak 976.56 KiB, end +976.56 KiB, ")
    assert text.endswith(" on cpu")
    assert "result" not in repr(m)  # the result may be a huge tensor
    assert isinstance(m, Measurement)


def test_str_of_negative_end():
    m = Measurement(peak_bytes=0, end_bytes=-3 * 1024 * 1024, time_s=0.041, device="cpu", result=None)
    assert str(m) == "peak 0 B, end -3.00 MiB, 41 ms on cpu"


# --------------------------------------------------------------------------- validation


def test_not_callable_raises_type_error():
    with pytest.raises(TypeError, match="callable.*int"):
        measure(3)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "", "meta", "cpu:1"])
def test_bad_device_string_raises_value_error(bad):
    with pytest.raises(ValueError) as info:
        measure(lambda: None, device=bad)
    message = str(info.value)
    assert repr(bad) in message


def test_bad_device_message_lists_accepted_forms():
    with pytest.raises(ValueError, match='"cpu", "cuda", "cuda:N"'):
        measure(lambda: None, device="gpu")


def test_bad_device_type_raises_type_error():
    with pytest.raises(TypeError, match="int"):
        measure(lambda: None, device=0)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
@pytest.mark.parametrize("dev", ["cuda", "cuda:0", torch.device("cuda")])
def test_cuda_without_cuda_raises_value_error(dev):
    with pytest.raises(ValueError, match="CUDA is not available"):
        measure(lambda: None, device=dev)


def test_explicit_cpu_device_forms():
    assert measure(lambda: None, device="cpu").device == "cpu"
    assert measure(lambda: None, device=torch.device("cpu")).device == "cpu"


def test_device_inferred_cpu_for_cpu_tensors():
    x = torch.ones(3)
    assert measure(torch.sum, x).device == "cpu"
    assert measure(lambda: None).device == "cpu"


# --------------------------------------------------------------------------- CUDA

# The caching allocator rounds blocks up to 512 bytes; sizes here are multiples of it.
CUDA_MB = 1 << 20
CUDA_FLOATS_PER_MB = CUDA_MB // 4


@requires_cuda
def test_cuda_allocation_kept_is_exact():
    m = measure(lambda: torch.empty(CUDA_FLOATS_PER_MB, device="cuda"), device="cuda")
    assert m.peak_bytes == m.end_bytes == CUDA_MB
    assert m.device == f"cuda:{torch.cuda.current_device()}"
    assert m.timeline == [(0.0, 0), (m.time_s, CUDA_MB)]


@requires_cuda
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


@requires_cuda
def test_cuda_preexisting_tensor_freed_is_negative():
    holder = [torch.empty(CUDA_FLOATS_PER_MB, device="cuda")]
    m = measure(holder.clear)  # inferred from the tensor in the closure
    assert m.device.startswith("cuda:")
    assert m.end_bytes == -CUDA_MB
    assert m.peak_bytes == 0


@requires_cuda
def test_cuda_device_inferred_from_args_and_modules():
    model = _small_mlp("cuda")
    x = torch.randn(64, 256, device="cuda")
    m = measure(_mlp_step, model, x)
    assert m.device == f"cuda:{x.device.index}"
    assert m.peak_bytes > 0
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    assert m.end_bytes >= grads
    assert measure(functools.partial(_mlp_step, model), x=x).device.startswith("cuda:")
    assert measure(lambda d: d["x"].sum(), {"x": x}).device.startswith("cuda:")


@requires_cuda
def test_cuda_kept_intermediates_peak_at_least_their_sum():
    x = torch.randn(CUDA_FLOATS_PER_MB, device="cuda")
    m = measure(_kept_intermediates, x, 5)
    assert m.peak_bytes >= 5 * CUDA_MB
    assert m.end_bytes == 5 * CUDA_MB


@requires_cuda
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


@requires_cuda
def test_cuda_cpu_measurement_ignores_cuda_memory():
    m = measure(lambda: torch.empty(CUDA_FLOATS_PER_MB, device="cuda"), device="cpu")
    assert m.peak_bytes < CUDA_MB  # only host-side bookkeeping, if any


@requires_cuda
def test_cuda_bad_index_raises_value_error():
    bad = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(ValueError, match="does not exist"):
        measure(lambda: None, device=bad)


# --------------------------------------------------------------------------- fallbacks
# The paths below are taken on torch versions without some profiler/storage API, or
# when the profiler's clock is not the Unix epoch; force them here.

_impl = sys.modules["memfit.measurement.measure"]


def test_fallback_without_block_addresses_still_counts_once(monkeypatch):
    monkeypatch.setattr(_impl, "_tree_cpu_memory_events", lambda results: None)
    first = measure(lambda: torch.empty(FLOATS_PER_MB))
    holder = [first.result]
    first = None
    m = measure(holder.clear)
    assert (m.peak_bytes, m.end_bytes) == (0, -MB)


def test_fallback_without_storage_preservation_counts_frees_at_the_end(monkeypatch):
    monkeypatch.setattr(_impl, "_storage_pyobject_preserved", lambda: False)
    holder = [torch.empty(FLOATS_PER_MB)]

    def swap():
        holder.clear()
        return torch.empty(2 * FLOATS_PER_MB)

    m = measure(swap)
    assert m.end_bytes == MB
    assert m.peak_bytes == 2 * MB  # free time unknown: counted last, an upper bound


def test_fallback_when_clocks_disagree(monkeypatch):
    class ShiftedTime:
        perf_counter = staticmethod(time.perf_counter)

        @staticmethod
        def time_ns() -> int:
            return time.time_ns() + 10**12  # 1000 s off the profiler's clock

    monkeypatch.setattr(_impl, "time", ShiftedTime)
    holder = [torch.empty(FLOATS_PER_MB)]

    def work():
        a = torch.empty(FLOATS_PER_MB)
        b = torch.empty(FLOATS_PER_MB)
        del a
        holder.clear()
        return b

    m = measure(work)
    assert m.end_bytes == 0
    assert m.peak_bytes == 2 * MB
    times = [t for t, _ in m.timeline]
    assert times == sorted(times) and times[0] == 0.0


def test_reachable_through_optimizer_partial_and_objects():
    model = torch.nn.Linear(500, 500, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 500)).sum().backward()
    opt.step()  # creates a 1 MB momentum buffer in opt.state

    class Trainer:
        def __init__(self, optimizer):
            self.optimizer = optimizer

        def drop_state(self):
            self.optimizer.state.clear()

    m = measure(Trainer(opt).drop_state)
    assert m.end_bytes == -MB

    def drop_grads(module):
        module.zero_grad(set_to_none=True)

    m = measure(functools.partial(drop_grads, model))
    assert m.end_bytes == -MB
