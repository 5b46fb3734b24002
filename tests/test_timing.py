"""``measurement.timing``: compiled steps timed against each other, interleaved, nothing the
caller sees changed."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from conftest import CUDA
from memfit.measurement.timing import CompiledStep, step_time_ratios


def _step(seconds: float, calls: list[str], name: str) -> CompiledStep:
    """A boxed forward that sleeps ``seconds`` and draws a random number (as dropout would),
    and a boxed backward that clears what it is given; each records its calls."""

    def forward(args: list[Any]) -> list[Any]:
        calls.append(f"{name} forward")
        (x,) = args
        args.clear()
        time.sleep(seconds)
        return [x * 2 + torch.rand(())]

    def backward(args: list[Any]) -> list[Any]:
        calls.append(f"{name} backward")
        (saved, grad) = args
        args.clear()
        return [saved * grad]

    def backward_inputs(outputs: Sequence[Any]) -> list[Any]:
        return [outputs[0], torch.ones(())]

    return CompiledStep(forward, backward, [torch.ones(())], backward_inputs)


def test_a_slower_step_measures_slower_and_the_first_is_the_unit() -> None:
    calls: list[str] = []
    fast, slow = _step(0.002, calls, "fast"), _step(0.02, calls, "slow")
    ratios = step_time_ratios([fast, slow], rounds=3)
    assert ratios[0] == 1.0
    assert ratios[1] > 3  # 10x the sleep: any machine's noise is far below that
    assert step_time_ratios([slow, fast], rounds=3)[1] < 1 / 3


def test_each_step_runs_once_untimed_then_once_a_round_in_a_rotating_order() -> None:
    calls: list[str] = []
    steps = [_step(0.0, calls, name) for name in ("a", "b", "c")]
    step_time_ratios(steps, rounds=3)
    forwards = [c.split()[0] for c in calls if c.endswith("forward")]
    assert forwards == ["a", "b", "c", "a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert len([c for c in calls if c.endswith("backward")]) == len(forwards)


def test_random_state_and_inputs_are_the_callers() -> None:
    calls: list[str] = []
    step = _step(0.0, calls, "a")
    torch.manual_seed(3)
    step_time_ratios([step, step], rounds=2)
    drawn = torch.rand(())
    torch.manual_seed(3)
    assert torch.equal(drawn, torch.rand(()))  # as if nothing had been drawn
    assert len(step.inputs) == 1  # the boxed forward cleared a copy of the list


def test_no_autograd_graph_is_built() -> None:
    """The compiled graphs compute gradients themselves: the forward runs without autograd
    recording, so nothing it makes holds a graph (or reaches a ``.grad``)."""
    weight = torch.ones((), requires_grad=True)
    made: list[torch.Tensor] = []

    def forward(args: list[Any]) -> list[Any]:
        made.append(args[0] * weight)
        return made[-1:]

    def backward(args: list[Any]) -> list[Any]:
        return [args[0]]

    step = CompiledStep(forward, backward, [torch.ones(())], lambda outputs: list(outputs))
    step_time_ratios([step], rounds=1)
    assert made and all(t.grad_fn is None for t in made)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="no steps"):
        step_time_ratios([], rounds=1)
    with pytest.raises(ValueError, match="at least 1"):
        step_time_ratios([_step(0.0, [], "a")], rounds=0)


@CUDA
def test_cuda_work_queued_by_a_step_is_timed() -> None:
    """Kernels launch asynchronously: a step's time includes the work it queued (the device is
    synchronized around each step), so a step of sixteen times the matrix products measures
    slower, however quickly its launches return."""

    def matmuls(count: int) -> CompiledStep:
        a = torch.randn(2048, 2048, device="cuda") / 2048**0.5  # products stay finite

        def forward(args: list[Any]) -> list[Any]:
            (x,) = args
            args.clear()
            for _ in range(count):
                x = x @ a
            return [x]

        return CompiledStep(forward, lambda args: [args[0]], [a], lambda outputs: list(outputs))

    assert step_time_ratios([matmuls(1), matmuls(16)], rounds=5)[1] > 4
