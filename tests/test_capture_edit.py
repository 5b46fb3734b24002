"""capture.edit: a bypassed node's readers read its replacement, and a graph is recompiled only
where a pass changed it."""

from __future__ import annotations

import torch
import torch.fx as fx

from memfit.capture.edit import bypass, recompiled


def _traced() -> fx.GraphModule:
    class Net(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.neg(x).exp()

    return fx.symbolic_trace(Net())


def test_a_bypassed_node_leaves_and_its_readers_read_the_replacement() -> None:
    gm = _traced()
    x = torch.randn(3)
    neg = next(n for n in gm.graph.nodes if n.target is torch.neg)
    bypass(neg, neg.args[0])
    assert neg not in gm.graph.nodes
    assert recompiled(gm, 1) == 1
    torch.testing.assert_close(gm(x), x.exp())  # the code was generated again


def test_an_unchanged_graph_is_not_recompiled() -> None:
    gm = _traced()
    code = gm.code
    neg = next(n for n in gm.graph.nodes if n.target is torch.neg)
    bypass(neg, neg.args[0])
    assert recompiled(gm, 0) == 0 and gm.code == code  # told nothing changed: left as it was
