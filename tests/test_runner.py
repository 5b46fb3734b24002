"""The benchmark runner (``memfit.bench.runner``): what it measures is what ``memfit.measure``
measures, timing rounds rotate, and one failing method is recorded while the others go on."""

from __future__ import annotations

import gc
import mmap
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import memfit
from memfit.bench.runner import (
    Method,
    Snapshot,
    attempt,
    first_step,
    measure_peak,
    measure_peaks,
    rotation,
    time_interleaved,
    warm_up,
)

CPU = torch.device("cpu")


def _method(
    name: str = "mlp",
    log: list[str] | None = None,
    fail_on_call: int | None = None,
    wrap: Callable[[nn.Module], nn.Module] | None = None,
    **kwargs: Any,
) -> Method:
    """A tiny MLP's training step, of ``wrap(model)`` if given. Each call appends ``name`` and
    whether automatic garbage collection was on to ``log``; call ``fail_on_call`` raises."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
    module = model if wrap is None else wrap(model)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    calls = []

    def step() -> None:
        calls.append(gc.isenabled())
        if log is not None:
            log.append(name)
        if len(calls) == fail_on_call:
            raise RuntimeError(f"{name} broke on call {len(calls)}")
        module(x).square().mean().backward()

    method = Method(name, model, step, module, **kwargs)
    method.gc_enabled_in_steps = calls  # type: ignore[attr-defined]
    return method


def test_rotation_starts_each_round_one_later() -> None:
    assert rotation(3, 4) == [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]
    assert rotation(1, 2) == [[0], [0]]
    assert rotation(0, 2) == [[], []]


def test_peak_is_memfit_measure_of_a_step_with_fresh_gradients() -> None:
    m = _method()
    first_step(m, CPU)  # leaves gradients behind; measure_peak must reset them
    assert m.record["first_step_s"] > 0
    measurement = measure_peak(m, CPU)

    m.zero_grad()
    direct = memfit.measure(m.step, device=CPU)
    assert m.record["peak_bytes"] == measurement.peak_bytes == direct.peak_bytes
    assert m.record["end_bytes"] == direct.end_bytes
    # the gradients a fresh step allocates (Linear weights and biases) are part of that peak
    grads = sum(p.numel() * 4 for p in m.model.parameters())
    assert direct.peak_bytes >= grads


def test_interleaved_rounds_rotate_and_time_every_step() -> None:
    log: list[str] = []
    methods = [_method(name, log) for name in "abc"]
    time_interleaved(methods, rounds=4, device=CPU)
    assert log == list("abcbcacababc")
    assert all(len(m.times) == 4 and min(m.times) > 0 for m in methods)
    # no automatic collection inside a timed step, and the collector is back on afterwards
    assert all(m.gc_enabled_in_steps == [False] * 4 for m in methods) and gc.isenabled()


def test_timing_freezes_the_heap_so_each_steps_collection_scans_only_new_objects() -> None:
    frozen_in_steps: list[int] = []
    method = _method()
    step = method.step
    method.step = lambda: (frozen_in_steps.append(gc.get_freeze_count()), step())
    heap = time_interleaved([method], rounds=3, device=CPU)
    # the objects alive at the start (the model among them) were out of every step's collection
    assert len(frozen_in_steps) == 3 and min(frozen_in_steps) > 0
    assert heap["frozen_objects"] >= max(frozen_in_steps)  # objects die, none are added
    assert heap["collect_s"] > 0 and heap["frozen_before"] == 0
    assert gc.get_freeze_count() == 0  # thawed afterwards


def test_timing_freezes_a_heap_someone_else_froze_too_and_leaves_it_frozen() -> None:
    gc.freeze()  # someone else's freeze, early
    early = gc.get_freeze_count()
    made_since = [[i] for i in range(1000)]  # objects alive at the timing's start, not frozen
    frozen_in_steps: list[int] = []
    method = _method()
    step = method.step
    method.step = lambda: (frozen_in_steps.append(gc.get_freeze_count()), step())
    try:
        heap = time_interleaved([method], rounds=2, device=CPU)
        assert 0 < heap["frozen_before"] <= early  # (a few early ones die)
        # what was made since the early freeze is out of each step's collection too
        assert min(frozen_in_steps) > early + len(made_since) // 2
        assert heap["frozen_objects"] >= max(frozen_in_steps)
        assert gc.get_freeze_count() > early  # not thawed: that would thaw the early freeze too
    finally:
        gc.unfreeze()


def test_a_turn_settles_untimed_then_times_its_steps_in_a_row() -> None:
    log: list[str] = []
    methods = [_method(name, log) for name in "ab"]
    time_interleaved(methods, rounds=2, device=CPU, settle=1, steps=2)
    # each turn runs its method three times in a row; round 2 starts with "b"
    assert log == list("aaabbb") + list("bbbaaa")
    for m in methods:
        assert len(m.times) == len(m.faults) == 4  # the settling steps are not recorded
        assert min(m.times) > 0 and min(m.faults) >= 0
        assert m.record["faults"] is m.faults
        # each turn's whole time: its two timed steps and its untimed one
        turns = m.record["turns_s"]
        assert len(turns) == 2
        assert turns[0] > m.times[0] + m.times[1] and turns[1] > m.times[2] + m.times[3]


def test_a_step_that_touches_fresh_memory_counts_its_page_faults() -> None:
    """The recorded faults are the process's, during the timed step: a step that writes 64 MiB
    of memory it has just mapped from the kernel faults once per page (4 KiB, or 2 MiB where the
    kernel backs it with transparent huge pages). Mapped directly: the allocator may hand a step
    memory an earlier test freed, already faulted in."""
    touched = 64 * 2**20

    def fresh() -> None:
        with mmap.mmap(-1, touched) as pages:
            written = torch.frombuffer(pages, dtype=torch.uint8)
            written.fill_(1)
            del written  # releases the buffer, so the mapping can close

    m = Method("fresh", nn.Linear(1, 1), fresh)
    time_interleaved([m], rounds=1, device=CPU, steps=2)
    assert min(m.faults) >= touched // (2 * 2**20)


def test_a_turn_needs_a_timed_step() -> None:
    with pytest.raises(ValueError, match="steps >= 1"):
        time_interleaved([_method()], rounds=1, device=CPU, steps=0)
    with pytest.raises(ValueError, match="settle >= 0"):
        time_interleaved([_method()], rounds=1, device=CPU, settle=-1)


def test_a_failing_method_is_recorded_and_the_others_go_on(capsys) -> None:
    log: list[str] = []
    ok, broken = _method("ok", log), _method("broken", log, fail_on_call=2)
    never = _method("never", log, fail_on_call=1)
    for m in (ok, broken, never):
        warm_up(m, CPU)
    assert never.failed and never.record["error_phase"] == "compiling (first step)"
    assert "RuntimeError: never broke on call 1" in never.record["error"]
    assert "never broke on call 1" in never.record["traceback"]

    time_interleaved([ok, broken, never], rounds=3, device=CPU)
    assert broken.failed and broken.record["error_phase"] == "timing"
    assert broken.times == [] and len(ok.times) == 3
    measure_peaks([ok, broken, never], CPU)
    assert "peak_bytes" in ok.record
    assert "peak_bytes" not in broken.record and "peak_bytes" not in never.record
    # first steps; timing round 1; rounds 2 and 3 without "broken"; the peak of "ok" alone
    assert log == ["ok", "broken", "never"] + ["ok", "broken"] + ["ok"] * 2 + ["ok"]
    out = capsys.readouterr().out
    assert "! never failed while compiling (first step): RuntimeError" in out
    assert "! broken failed while timing: RuntimeError" in out


def test_without_recording_the_error_is_raised() -> None:
    m = _method(fail_on_call=1, record_failures=False)
    with pytest.raises(RuntimeError, match="broke on call 1"):
        attempt(m, "compiling (first step)", m.step)
    assert not m.failed and "error" not in m.record


def test_memfit_wrapper_plan_recorded_and_watched() -> None:
    m = _method("plain")
    wrapped = _method("memfit-none", wrap=lambda model: memfit.checkpoint(model, "none"))
    for method in (m, wrapped):
        assert warm_up(method, CPU)
    plan = wrapped.module.memfit.plan
    assert wrapped.record["predicted_peak_bytes"] == plan.predicted_peak_bytes
    assert wrapped.record["graphs"] == len(plan.graphs) == 1
    assert wrapped.record["notes"] == [plan.graphs[0].note]
    assert "predicted_peak_bytes" not in m.record

    before = Snapshot([m, wrapped])
    measure_peaks([m, wrapped], CPU)
    time_interleaved([m, wrapped], rounds=2, device=CPU)
    assert before.graphs_compiled() == 0
    assert before.plan_changed(wrapped) is False and before.plan_changed(m) is None
    assert before.plans == {wrapped: plan}
