"""Which outputs are held, and which get a gradient, when a backward starts
(``analysis.backward_start``), and how the simulator walks that backward."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memfit.analysis.backward_start import assumed_start, running_backward
from memfit.analysis.graph import BackwardStart, JointGraph
from memfit.analysis.simulate import simulate_step
from memfit.bench.graphs import joint_graphs


class _LossAndLogits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 256))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.body(x)
        return F.cross_entropy(logits, y), logits


def _graph(model: nn.Module, *args: torch.Tensor) -> JointGraph:
    (jg,) = joint_graphs(model, *args)
    return jg


def _loss_graph() -> JointGraph:
    return _graph(_LossAndLogits(), torch.randn(128, 16), torch.randint(0, 256, (128,)))


def test_a_graph_returning_a_loss_is_assumed_to_give_only_the_loss_a_gradient() -> None:
    jg = _loss_graph()
    start = assumed_start(jg)
    scalar = [n.name for n in jg.fwd_outputs if n.meta["val"].dim() == 0]
    others = [n.name for n in jg.fwd_outputs if n.meta["val"].dim() > 0]
    assert scalar and others
    assert start.dropped == frozenset(others)
    assert start.missing == frozenset(t.name for t in jg.tangents if t.meta["val"].dim() > 0)


def test_a_graph_without_a_loss_is_assumed_held_with_every_gradient() -> None:
    jg = _graph(nn.Linear(16, 8), torch.randn(4, 16))
    assert assumed_start(jg) == BackwardStart()
    jg.backward_start = assumed_start(jg)
    assert running_backward(jg) is None


def test_dropped_logits_without_a_gradient_leave_the_backward() -> None:
    """Simulated as the step runs, the logits (128 x 256 floats) are neither held through the
    backward nor met by a gradient of their size at its start."""
    jg = _loss_graph()
    logits = next(n for n in jg.fwd_outputs if n.meta["val"].dim() > 0)
    logits_bytes = jg.bytes_of([logits])
    kept = set(jg.forward)
    every = simulate_step(jg, kept)
    jg.backward_start = assumed_start(jg)
    view = running_backward(jg)
    assert view is not None
    missing = [t for t in jg.tangents if t.name in jg.backward_start.missing]
    assert missing and not any(t in view.inputs[n] for n in view.nodes for t in missing)
    assumed = simulate_step(jg, kept)
    assert every.backward_peak_bytes - assumed.backward_peak_bytes >= logits_bytes
    assert assumed.forward_peak_bytes == every.forward_peak_bytes  # the forward is the same
