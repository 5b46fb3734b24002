"""Which of a few compiled forward/backward pairs runs fastest, timed on the step's own inputs.

Why time at all: under ``executor="inductor"`` memfit's cost model prices a plan by the FLOPs
and bytes of what it recomputes, and Inductor fuses the recomputation of memory-bound ops into
the backward's kernels, where the model cannot see what it costs. Measured on a CPU ResNet with
BatchNorm (``docs/measurements.md``), the plan keeping everything the
model called cheapest ran 1.04x the step of a plan keeping half as much, while on a U-Net plans
keeping less ran 4-12% slower (``docs/measurements.md``): no byte count told the two
apart. So where two plans both fit a budget and the model cannot rank them, and the user asked
for it (``autotune=True``: it costs one more compile), their compiled graphs are run and timed,
as the graphs' peaks are measured (``calibrate``).

How: each pair runs once untimed (first calls load kernels), then ``rounds`` rounds, each pair
once per round, the order rotating so no pair always runs after the same one; each pair's time
in a round is divided by the first pair's in that round, and the median over rounds is its
ratio. Per-round ratios cancel what a shared machine's drift adds to all pairs alike, which
per-pair medians do not. Nothing the caller sees changes: no gradient reaches a ``.grad``, the
inputs a forward writes into are the caller's copies, and the random-number generators are
restored afterwards.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CompiledStep", "step_time_ratios", "inputs_device", "cuda_index", "synchronize"]


@dataclass(frozen=True)
class CompiledStep:
    """One compiled pair, boxed (each takes a list it may clear), and what it runs on."""

    forward: Callable[[list[Any]], Any]
    backward: Callable[[list[Any]], Any]
    inputs: Sequence[Any]
    #: the backward's arguments, made from the forward's outputs
    backward_inputs: Callable[[Sequence[Any]], list[Any]]


def step_time_ratios(steps: Sequence[CompiledStep], rounds: int) -> list[float]:
    """Each step's median, over ``rounds`` interleaved rounds, of its time over the first
    step's time in the same round (the first's own ratio is 1.0)."""
    if not steps:
        raise ValueError("step_time_ratios: no steps to time")
    if rounds < 1:
        raise ValueError(f"step_time_ratios: rounds must be at least 1, not {rounds}")
    device = next((d for d in (inputs_device(s.inputs) for s in steps) if d is not None), None)
    cuda = [cuda_index(device)] if device is not None and device.type == "cuda" else []
    ratios: list[list[float]] = [[] for _ in steps]
    with torch.random.fork_rng(devices=cuda), torch.no_grad():
        for step in steps:
            _run(step, device)
        for r in range(rounds):
            seconds = [0.0] * len(steps)
            for k in range(len(steps)):
                i = (r + k) % len(steps)
                seconds[i] = _run(steps[i], device)
            for i, s in enumerate(seconds):
                ratios[i].append(s / seconds[0])
    return [statistics.median(r) for r in ratios]


def _run(step: CompiledStep, device: torch.device | None) -> float:
    """Seconds one forward and backward take, the device's queued work included."""
    synchronize(device)
    start = time.perf_counter()
    outputs = step.forward(list(step.inputs))
    args = step.backward_inputs(outputs)
    del outputs
    grads = step.backward(args)
    del grads, args
    synchronize(device)
    return time.perf_counter() - start


def synchronize(device: torch.device | None) -> None:
    """Wait for ``device``'s queued work (CUDA); nothing to wait for on CPU or None."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def cuda_index(device: torch.device) -> int:
    """The index of a CUDA ``device``, the current one where it names none."""
    return device.index if device.index is not None else torch.cuda.current_device()


def inputs_device(inputs: Sequence[Any]) -> torch.device | None:
    """The device of the first tensor among ``inputs`` (a compiled graph's), None if none is."""
    for t in inputs:
        if isinstance(t, torch.Tensor):
            return t.device
    return None
