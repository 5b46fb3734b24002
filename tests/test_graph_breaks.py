"""A model Dynamo cannot capture as one graph still trains exactly, saves memory in each piece,
and tells the user once where the graph broke."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import memfit
from memfit._compat import graph_break_reasons
from memfit.capture import graph_breaks
from memfit.capture.graph_breaks import GraphBreakWatcher


class Branchy(nn.Module):
    """Two deep tanh stacks separated by a Python `if` on a tensor value (a graph break)."""

    def __init__(self, depth: int = 24, width: int = 256) -> None:
        super().__init__()
        self.first = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.second = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.first:
            x = torch.tanh(layer(x))
        if x.sum() > 0:  # data-dependent control flow
            x = x * 2
        for layer in self.second:
            x = torch.tanh(layer(x))
        return x


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_graph_break_trains_exactly_and_warns_once_with_location() -> None:
    torch.manual_seed(0)
    model = Branchy()
    x = torch.randn(512, 256)
    expected = _grads(model, x)
    wrapped = memfit.checkpoint(model, "memory")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _grads(wrapped, x)
        _grads(wrapped, x)
        _grads(wrapped, x)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    ours = [w for w in caught if "memfit could not capture" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    message = str(ours[0].message)
    assert "Branchy" in message and "test_graph_breaks.py" in message
    assert ours[0].filename == __file__  # attributed to the calling line, not to torch
    assert len(wrapped.plan.graphs) >= 2


def test_graph_break_still_saves_memory() -> None:
    torch.manual_seed(0)
    x = torch.randn(2048, 256)  # activations well above the 12 MB of weight gradients

    def peak(mode: str) -> int:
        torch.compiler.reset()
        torch.manual_seed(0)
        wrapped = memfit.checkpoint(Branchy(), mode)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _grads(wrapped, x)
            result = memfit.measure(lambda: wrapped(x).square().mean().backward())
        assert result.peak_bytes is not None
        return result.peak_bytes

    assert peak("memory") < 0.6 * peak("none")


def _breaks(x: torch.Tensor) -> torch.Tensor:
    x = x + 1
    if x.sum() > 0:  # data-dependent control flow: a graph break
        x = x * 2
    return x - 1


def test_watcher_reports_each_conversions_breaks_and_reads_reasons_only_after_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The watcher reads Dynamo's reasons only when a frame was converted, yet finds every new
    break, after Dynamo's counters are cleared too (the same reason then counts from 1 again, not
    above the count last read)."""
    watcher = GraphBreakWatcher("fn")
    reads = []

    def counted() -> dict[str, int]:
        reads.append(1)
        return graph_break_reasons()

    monkeypatch.setattr(graph_breaks, "graph_break_reasons", counted)
    for _ in range(2):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        compiled = torch.compile(_breaks, backend="eager")
        with watcher.watch() as report:
            compiled(torch.ones(3))
        assert report.broke
        with watcher.watch() as report:  # served from Dynamo's cache: no frame converted
            reads.clear()
            compiled(torch.ones(3))
        assert not report.broke
        assert not reads
