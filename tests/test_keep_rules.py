"""The keep-set rules read the model's structure as written (``planning.keep_rules``).

What each rule keeps, measured on real steps, is tested per policy in ``tests/test_policies.py``;
here, the pure parts of the rules.
"""

from __future__ import annotations

import torch

from memfit.bench.graphs import joint_graphs
from memfit.planning.keep_rules import _block, input_derived, keep_all


def test_blocks_are_read_from_module_paths() -> None:
    class Node:
        def __init__(self, *paths: str) -> None:
            self.meta = {"nn_module_stack": {str(i): (p, object) for i, p in enumerate(paths)}}

    assert _block(Node("L['self'].model", "L['self'].model.layers.3", "x.layers.3.mlp")) == (
        "L['self'].model.layers.3"
    )
    assert _block(Node("L['self'].h[2]", "L['self'].h[2].attn")) == "L['self'].h[2]"
    assert _block(Node("L['self'].head")) is None
    assert _block(Node()) is None


class _ScaledByPadding(torch.nn.Module):
    """A linear layer whose output is scaled by a factor made from a padding mask alone, as an
    attention mask is made from one: the backward reads the factor, not the mask."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        scale = torch.where(pad.bool(), 1.0, 0.5).unsqueeze(-1).expand(-1, -1, 16).contiguous()
        return (self.lin(x) * scale).tanh().sum()


def test_values_made_from_inputs_alone_are_made_again_not_kept() -> None:
    """``keep_all`` ("none") keeps no value made by cheap ops from inputs that get no gradient
    (``input_derived``): the backward makes it again from the input, which the caller holds."""
    x = torch.randn(4, 8, 16, requires_grad=True)
    pad = torch.ones(4, 8, dtype=torch.long)
    (jg,) = joint_graphs(_ScaledByPadding(), x, pad)
    derived = input_derived(jg)
    targets = {str(n.target) for n in derived}
    assert "aten.where.self" in targets and "aten.clone.default" in targets
    heavy = ("aten.addmm", "aten.mm", "aten.tanh")
    assert not any(str(n.target).startswith(heavy) for n in derived)
    kept = keep_all(jg)
    assert not kept & derived
    pad_primal = next(p for p in jg.primals if p.meta["val"].dtype == torch.long)
    assert pad_primal in kept  # what the factor is made again from
    everything = jg.saved_needed([n for n in jg.forward if jg.is_tensor_value(n)])
    assert jg.bytes_of(kept) < jg.bytes_of(everything)
