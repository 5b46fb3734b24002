"""The joint-graph rewrites before planning: under Inductor, ``torch.compile``'s own first."""

from __future__ import annotations

from collections import Counter

import torch
import torch.fx as fx

import memfit
from conftest import conv_bn_net
from memfit._compat import is_tangent
from memfit.bench.graphs import joint_graphs
from memfit.execution.executors import EAGER, INDUCTOR


def _backward_repeats(graph: fx.Graph) -> int:
    """Computations of the backward (from the first reader of a tangent) made twice."""
    nodes = list(graph.nodes)
    start = min(nodes.index(u) for n in nodes if is_tangent(n) for u in n.users)
    keys = Counter(
        (n.target, repr(n.args), repr(n.kwargs))
        for n in nodes[start:]
        if n.op == "call_function" and n.target is torch.ops.aten.sub.Tensor
    )
    return sum(c - 1 for c in keys.values())


def test_inductor_plans_the_backward_with_its_repeats_merged() -> None:
    # Inductor's decomposed BatchNorm backward computes x - mean twice; torch.compile merges
    # them before Inductor fuses the graph, and so, under Inductor, does memfit
    x = torch.randn(2, 3, 8, 8)
    (raw,) = joint_graphs(conv_bn_net(), x, executor=INDUCTOR, prepared=False)
    (planned,) = joint_graphs(conv_bn_net(), x, executor=INDUCTOR)
    assert _backward_repeats(raw.module.graph) > 0
    assert _backward_repeats(planned.module.graph) == 0


def test_the_eager_executor_plans_eagers_ops_as_they_are() -> None:
    x = torch.randn(2, 3, 8, 8)
    (raw,) = joint_graphs(conv_bn_net(), x, executor=EAGER, prepared=False)
    (planned,) = joint_graphs(conv_bn_net(), x, executor=EAGER)
    targets = Counter(n.target for n in raw.module.graph.nodes if n.op == "call_function")
    after = Counter(n.target for n in planned.module.graph.nodes if n.op == "call_function")
    # the only rewrite: one BatchNorm twin (and its three getitems) per BatchNorm
    twin = torch.ops.aten._native_batch_norm_legit.no_stats
    assert after - targets == Counter({twin: 2})


def test_rewritten_graph_trains_as_eager_does() -> None:
    # gradients to fp32 tolerance, and BatchNorm's running statistics, which only a write into
    # the buffers carries out of the graph, kept through dead-code elimination
    x = torch.randn(2, 3, 8, 8)
    eager = conv_bn_net()
    eager(x).square().sum().backward()
    model = conv_bn_net()
    memfit.checkpoint(model, "memory", executor=INDUCTOR)(x).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    for b, c in zip(model.buffers(), eager.buffers()):
        torch.testing.assert_close(b, c)
