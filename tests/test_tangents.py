"""The backward specialized to the tangents that arrive as None (``capture.tangents``)."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from memfit.capture.tangents import without_tangents


def _backward(x: torch.Tensor, tangents_1: torch.Tensor, tangents_2: torch.Tensor) -> tuple:
    """The shape of a backward graph: ``cos`` is recomputed only for the first tangent."""
    recomputed = torch.cos(x)
    return (tangents_1 * recomputed + tangents_2 * 2,)


def _graph() -> fx.GraphModule:
    gm = make_fx(_backward)(torch.randn(4), torch.randn(4), torch.randn(4))
    names = iter(["x", "tangents_1", "tangents_2"])
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            n.name = n.target = next(names)
    gm.recompile()
    return gm


def _targets(gm: fx.GraphModule) -> set[object]:
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


def test_what_only_a_missing_tangent_needed_is_not_computed() -> None:
    """The recomputation read only by the missing tangent's product is removed too: it ran for
    nothing (and the simulator, which walks this graph, would not count it)."""
    gm = _graph()
    assert torch.ops.aten.cos.default in _targets(gm)
    specialized = without_tangents(gm, {"tangents_1"})
    assert torch.ops.aten.cos.default not in _targets(specialized)
    x, t2 = torch.randn(4), torch.randn(4)
    (got,) = specialized(x, None, t2)
    torch.testing.assert_close(got, t2 * 2)


def test_a_graph_whose_tangents_all_arrive_is_unchanged() -> None:
    gm = _graph()
    specialized = without_tangents(gm, set())
    assert _targets(specialized) == _targets(gm)
    x, t1, t2 = torch.randn(4), torch.randn(4), torch.randn(4)
    torch.testing.assert_close(specialized(x, t1, t2)[0], _backward(x, t1, t2)[0])
