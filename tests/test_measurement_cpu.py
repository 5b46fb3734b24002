"""Tests for memfit.measurement.cpu: exact CPU tensor memory from profiler events, nesting."""

from __future__ import annotations

import threading
import time
import weakref

import pytest
import torch
from torch.profiler import ProfilerActivity

from measuring import FLOATS_PER_MB, MB, kept_intermediates, mlp_step, small_mlp
from memfit._compat import profiler_events
from memfit.measurement import cpu, measure
from memfit.measurement.cpu import CpuRecording, cpu_recording_blocked

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


def test_a_watched_tensor_is_not_kept_alive_by_the_recording():
    """Watching a tensor sees its free; it must not delay it (a window watching a step's
    output held the logits the caller dropped until its backward ended: 8 MB above the step)."""
    tensors = [torch.empty(FLOATS_PER_MB)]
    alive = weakref.ref(tensors[0].untyped_storage())
    with CpuRecording(watch=list(tensors)) as recording:
        tensors.clear()
        assert alive() is None
    assert recording.memory().end_bytes == -MB


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
    m = measure(kept_intermediates, x, n)
    assert m.peak_bytes >= n * MB
    assert m.end_bytes == n * MB


def test_cpu_autograd_saved_tensors_are_counted():
    x = torch.randn(FLOATS_PER_MB, requires_grad=True)
    n = 4

    def forward():
        return kept_intermediates(x, n)[-1].sum()

    m = measure(forward)
    # tanh saves its output for backward: n tensors of 1 MB stay alive with the graph.
    assert m.peak_bytes >= n * MB
    assert m.end_bytes >= n * MB


def test_cpu_mlp_forward_backward():
    torch.manual_seed(0)
    model = small_mlp()
    x = torch.randn(64, 256)
    m = measure(mlp_step, model, x)
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


def test_exception_propagates_and_profiler_is_stopped():
    def boom():
        torch.empty(FLOATS_PER_MB)
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        measure(boom)
    # The profiler must not be left running: a second measurement works.
    assert measure(lambda: torch.empty(FLOATS_PER_MB)).peak_bytes == MB


@pytest.mark.slow
def test_nested_cpu_measure_refuses():
    with pytest.raises(RuntimeError, match="another torch profiler"):
        measure(lambda: measure(lambda: torch.empty(10)))
    # ...and time-only nesting is fine.
    outer = measure(lambda: measure(lambda: torch.empty(FLOATS_PER_MB), profile_memory=False))
    assert outer.peak_bytes == MB


# --------------------------------------------------------------------------- other sessions
# See NOTE [Why CPU recordings do not nest by pausing] in memfit/measurement/cpu.py.


def test_cpu_measure_inside_a_user_profiler_refuses_and_leaves_it_intact():
    with torch.profiler.profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with pytest.raises(RuntimeError, match="another torch profiler"):
            measure(lambda: torch.empty(10))
        kept = torch.empty(FLOATS_PER_MB)
    assert MB in [ev.nbytes() for ev in profiler_events(prof) if ev.name() == "[memory]"]
    del kept


def test_recordings_do_not_nest():
    with CpuRecording() as outer:
        with pytest.raises(RuntimeError, match="cannot record CPU memory now"):
            with CpuRecording():
                pass
        with pytest.raises(RuntimeError, match="once the recording has ended"):
            outer.memory()
        kept = torch.empty(FLOATS_PER_MB)
    assert (outer.memory().peak_bytes, outer.memory().end_bytes) == (MB, MB)
    assert cpu_recording_blocked() is None
    del kept


def _on_thread(fn):
    """Run fn on a new thread; return what it returned or the exception it raised."""
    out = []

    def run():
        try:
            out.append(fn())
        except Exception as err:  # noqa: BLE001 - handed back to the test
            out.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out[0]


def test_cpu_measure_beside_a_session_on_another_thread_refuses_instead_of_crashing():
    # A second profiler session on another thread would crash the process.
    err = measure(lambda: _on_thread(lambda: measure(lambda: torch.empty(10)))).result
    assert isinstance(err, RuntimeError) and "another torch profiler" in str(err)
    with torch.profiler.profile(activities=[ProfilerActivity.CPU]):
        err = _on_thread(lambda: measure(lambda: torch.empty(10)))
    assert isinstance(err, RuntimeError) and "another torch profiler" in str(err)


# --------------------------------------------------------------------------- fallbacks
# The paths below are taken when the profiler gives no block addresses, or when its
# clock is not the Unix epoch; force them here.


def test_fallback_without_block_addresses_still_counts_once(monkeypatch):
    monkeypatch.setattr(cpu, "profiler_allocations", lambda prof: None)
    first = measure(lambda: torch.empty(FLOATS_PER_MB))
    holder = [first.result]
    first = None
    m = measure(holder.clear)
    assert (m.peak_bytes, m.end_bytes) == (0, -MB)


def test_storage_python_object_lives_as_long_as_the_storage():
    # Why there is no fallback for frees of pre-existing storages: the weakref on a storage's
    # Python object fires exactly when the memory goes, not when the tensor's object does.
    t = torch.empty(FLOATS_PER_MB)
    assert t.untyped_storage() is t.untyped_storage()
    died = []
    ref = weakref.ref(t.untyped_storage(), lambda _: died.append(True))
    view = t[1:]
    del t
    assert not died and ref() is not None
    del view
    assert died


def test_fallback_when_clocks_disagree(monkeypatch):
    class ShiftedTime:
        perf_counter = staticmethod(time.perf_counter)

        @staticmethod
        def time_ns() -> int:
            return time.time_ns() + 10**12  # 1000 s off the profiler's clock

    monkeypatch.setattr(cpu, "time", ShiftedTime)
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


def test_window_peaks_are_per_window_and_above_each_windows_start():
    windows = []
    held = []
    with CpuRecording() as recording:
        held.append(torch.empty(MB, dtype=torch.uint8))  # before any window: the base rises
        for size in (3 * MB, 1 * MB):
            start = time.time_ns()
            scratch = torch.empty(size, dtype=torch.uint8)
            kept = torch.empty(MB // 2, dtype=torch.uint8)
            del scratch
            end = time.time_ns()
            windows.append((start, end))
            held.append(kept)
    assert recording.window_peaks(windows) == [3 * MB + MB // 2, MB + MB // 2]
    with pytest.raises(RuntimeError, match="ended"):
        CpuRecording().window_peaks([])


def test_levels_are_the_bytes_live_at_each_mark_above_the_first():
    marks = []
    with CpuRecording() as recording:
        scratch = torch.empty(2 * MB, dtype=torch.uint8)  # before the first mark: not counted
        marks.append(time.time_ns())
        kept = torch.empty(MB, dtype=torch.uint8)
        marks.append(time.time_ns())
        del scratch  # freed: the level falls below the first mark's
        marks.append(time.time_ns())
        del kept
    assert recording.levels(marks) == [0, MB, -MB]
