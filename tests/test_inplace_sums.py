"""memfit.capture.inplace_sums: gradient sums made in place, as eager autograd makes them.

The oracle is plain PyTorch: the same gradients bit for bit, and a peak no higher than eager
autograd's, predicted to the byte.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import memfit
from memfit.bench.graphs import joint_graphs
from memfit.capture.inplace_sums import INPLACE_OPERAND, inplace_sums

aten = torch.ops.aten


class _Scan(nn.Module):
    """Mamba's shape: one [batch, length, width] value read step by step, so its gradient is a
    sum of ``length`` full-size parts (one ``select_backward`` each)."""

    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x).exp()
        state = torch.zeros_like(h[:, 0])
        outs = []
        for i in range(h.shape[1]):
            state = state * 0.9 + h[:, i]
            outs.append(state)
        return torch.stack(outs, dim=1).square().mean()


def _x() -> torch.Tensor:
    return torch.randn(8, 16, 256, generator=torch.Generator().manual_seed(0))


def test_the_scans_gradient_sums_are_found_in_its_backward() -> None:
    torch.manual_seed(0)
    (jg,) = joint_graphs(_Scan(), _x())
    found = inplace_sums(jg.module.graph.nodes)
    assert len(found) >= 15  # the 16 parts of h's gradient summed in 15 adds, at least
    for total, operand in found.items():
        assert total.target is aten.add.Tensor and list(operand.users) == [total]
        assert total.meta[INPLACE_OPERAND] == total.args.index(operand)  # tagged when prepared
        assert jg.storages[total] == jg.storages[operand]  # counted in the operand's storage


class _Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        return (h.tanh() + h.sigmoid() + h).sum()  # h read three times: its gradient, a sum


def test_only_gradients_are_summed_into_never_a_forward_value() -> None:
    torch.manual_seed(0)
    (jg,) = joint_graphs(_Branches(), torch.randn(4, 8))
    found = inplace_sums(jg.module.graph.nodes)
    assert found
    assert all(jg.is_backward(operand) for operand in found.values())
    forward_adds = [n for n in jg.forward if n.target is aten.add.Tensor]
    assert forward_adds and not any(n in found for n in forward_adds)


def _step(model: nn.Module, x: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    m = memfit.measure(lambda: model(x).backward())
    assert m.peak_bytes is not None
    return m.peak_bytes, [p.grad.clone() for p in model.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["none", "memory"])
def test_a_sum_of_many_parts_holds_two_at_a_time_as_eager_autograd(policy: str) -> None:
    """h's gradient is 16 full-size parts summed. The forward leaves two parts' worth alive (h for
    exp's backward, the stacked states for square's); summed in place the backward adds the sum
    and one part (532,488 bytes in all), out of place it held a third (663,560)."""
    torch.manual_seed(0)
    model, x = _Scan(), _x()
    part = x.numel() * 4  # h is [8, 16, 256] fp32, like x
    _, expected = _step(model, x)
    memfit.checkpoint(model, policy)
    for _ in range(2):
        peak, grads = _step(model, x)
        assert all(torch.equal(g, e) for g, e in zip(grads, expected))
        assert peak < 4.5 * part
    assert peak == model.memfit.plan.predicted_peak_bytes  # once captured, to the byte
