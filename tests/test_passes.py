"""The joint-graph rewrites before planning: under Inductor, ``torch.compile``'s own first."""

from __future__ import annotations

import torch
import torch.nn as nn

import memfit
from memfit.bench.graphs import joint_graphs
from memfit.execution.executors import EAGER, INDUCTOR

RELU = torch.ops.aten.relu.default


class _SameTwice(nn.Module):
    """One subexpression written twice: eager computes it twice, ``torch.compile`` once."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        return torch.relu(h) * torch.relu(h)


def _relus(executor: str) -> int:
    torch.manual_seed(0)
    (jg,) = joint_graphs(_SameTwice(), torch.randn(4, 8), executor=executor)
    return sum(1 for n in jg.module.graph.nodes if n.target is RELU)


def test_inductor_plans_the_graph_with_common_subexpressions_merged() -> None:
    # torch.compile's partitioner merges them (fx_graph_cse) before Inductor fuses the graph;
    # memfit's Inductor executor plans that graph, the eager executor eager's ops as they are
    assert _relus(INDUCTOR) == 1
    assert _relus(EAGER) == 2


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 4),
    )


def test_rewritten_graph_trains_as_eager_does() -> None:
    # gradients to fp32 tolerance, and BatchNorm's running statistics, which only a write into
    # the buffers carries out of the graph, kept through dead-code elimination
    x = torch.randn(2, 3, 8, 8)
    eager = _bn_net()
    eager(x).square().sum().backward()
    model = _bn_net()
    memfit.checkpoint(model, "memory", executor=INDUCTOR)(x).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    for b, c in zip(model.buffers(), eager.buffers()):
        torch.testing.assert_close(b, c)
