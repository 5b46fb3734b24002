"""``measurement.window``: the peak of code memfit does not run, between two of its calls.

On CPU a window asks the memfit recording that is running (a ``memfit.measure``) for its peak,
delivered when that recording ends; with none running it opens only where asked to record on its
own, and that recording ends at the next safe point (``MemoryWindow.settle``: a memfit call, an
optimizer step, a ``memfit.measure``), never where the window closes, inside the autograd engine.
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

import memfit
from conftest import CUDA
from memfit.measurement.window import MemoryWindow

MB = 1_000_000


def _transient(n_mb: int) -> torch.Tensor:
    """Allocate n_mb MB and n_mb MB more, free the second: peak 2 n_mb, keep n_mb."""
    a = torch.ones(n_mb * MB // 4)
    b = a.mul(a)
    del b
    return a


def test_inside_a_memfit_measure_the_peak_arrives_when_the_measure_ends() -> None:
    got: list[int] = []

    def step() -> None:
        torch.ones(4 * MB // 4)  # before the window: a peak the window must not see
        window = MemoryWindow.open(torch.device("cpu"), got.append)
        assert window is not None
        kept = _transient(1)
        window.close()
        torch.ones(3 * MB // 4)  # after it: not in the window either
        assert got == []  # not yet: the enclosing recording is still running
        del kept

    measured = memfit.measure(step)
    assert got == [2 * MB]
    assert measured.peak_bytes == 4 * MB


def test_an_abandoned_window_delivers_nothing() -> None:
    got: list[int] = []

    def step() -> None:
        window = MemoryWindow.open(torch.device("cpu"), got.append)
        assert window is not None
        _transient(1)
        window.abandon()
        window.close()

    memfit.measure(step)
    assert got == []


def test_no_window_on_cpu_without_a_memfit_recording() -> None:
    assert MemoryWindow.open(torch.device("cpu"), lambda peak: None) is None
    with profile(activities=[ProfilerActivity.CPU]):  # someone else's profiler
        assert MemoryWindow.open(torch.device("cpu"), lambda peak: None) is None
        assert MemoryWindow.open(torch.device("cpu"), lambda peak: None, record=True) is None
        assert not MemoryWindow.can_open(record=True)


def test_a_window_recording_on_its_own_delivers_when_settled() -> None:
    """Asked to record, a window starts its own recording, sees the frees of the tensors it
    watches (an output dropped inside it), and delivers at ``settle``, not at ``close``."""
    got: list[int] = []
    held = torch.ones(4 * MB // 4)
    assert MemoryWindow.can_open(record=True)
    window = MemoryWindow.open(torch.device("cpu"), got.append, record=True, watch=[held])
    assert window is not None
    del held  # -4 MB, seen through the watch
    kept = _transient(2)  # +4 MB at its peak, above the window's start 0
    window.close()
    assert got == []
    MemoryWindow.settle()
    assert got == [0]
    window = MemoryWindow.open(torch.device("cpu"), got.append, record=True)
    assert window is not None
    more = _transient(1)
    window.close()
    MemoryWindow.settle()
    assert got == [0, 2 * MB]
    MemoryWindow.settle()  # nothing runs: nothing happens
    del kept, more


def test_an_optimizer_step_or_a_memfit_measure_ends_a_windows_recording() -> None:
    got: list[int] = []
    weight = torch.nn.Parameter(torch.ones(4))
    weight.grad = torch.zeros(4)
    optimizer = torch.optim.SGD([weight], lr=0.1)
    for settle in (optimizer.step, lambda: memfit.measure(lambda: None)):
        window = MemoryWindow.open(torch.device("cpu"), got.append, record=True)
        assert window is not None
        kept = _transient(1)
        window.close()
        settle()
        assert got[-1] == 2 * MB
        del kept
    assert len(got) == 2
    assert MemoryWindow.open(torch.device("cpu"), lambda peak: None) is None  # none left running


@CUDA
def test_a_cuda_window_delivers_at_close() -> None:
    got: list[int] = []
    window = MemoryWindow.open(torch.device("cuda"), got.append)
    assert window is not None
    a = torch.ones(MB // 4, device="cuda")
    b = a.mul(a)
    del b
    window.close()
    assert got and got[0] >= 2 * MB


def test_levels_inside_a_memfit_measure_arrive_when_the_measure_ends() -> None:
    got: list[list[int]] = []

    def step() -> None:
        from memfit.measurement.window import MemoryLevels

        before = torch.ones(2 * MB // 4)  # live before the first mark: not counted
        levels = MemoryLevels.open(torch.device("cpu"), got.append)
        assert levels is not None
        kept = _transient(1)  # a transient peak between marks is not a level
        levels.mark()
        del before
        levels.mark()
        levels.close()
        levels.mark()  # closed: ignored
        assert got == []
        del kept

    memfit.measure(step)
    assert got == [[0, MB, -MB]]
