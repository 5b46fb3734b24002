"""FLOPs per node agree with torch's FlopCounterMode formulas; heavy ops are recognised."""

import pytest
import torch
import torch.nn as nn

from memfit.analysis.cost import (
    DEVICE_SPEED,
    is_compute_heavy,
    keeping_seconds,
    node_flops,
    node_seconds,
)
from memfit.analysis.sizes import Sizes
from memfit.bench.graphs import joint_graphs


def test_matmul_flops_and_heaviness() -> None:
    (jg,) = joint_graphs(nn.Sequential(nn.Linear(32, 64), nn.ReLU()), torch.randn(8, 32))
    addmm = next(n for n in jg.forward if n.target is torch.ops.aten.addmm.default)
    relu = next(n for n in jg.forward if n.target is torch.ops.aten.relu.default)
    assert node_flops(addmm) == 2 * 8 * 32 * 64
    assert is_compute_heavy(addmm) and not is_compute_heavy(relu)
    assert node_flops(relu) == 8 * 64  # one per output element


def test_fused_elementwise_costs_its_arithmetic_only() -> None:
    """Under a fusing executor an elementwise op moves no bytes of its own; a matrix product is
    its own kernel either way."""
    (jg,) = joint_graphs(nn.Sequential(nn.Linear(32, 64), nn.ReLU()), torch.randn(8, 32))
    addmm = next(n for n in jg.forward if n.target is torch.ops.aten.addmm.default)
    relu = next(n for n in jg.forward if n.target is torch.ops.aten.relu.default)
    assert node_seconds(addmm, fused=True) == node_seconds(addmm)
    assert node_seconds(relu, fused=True) == node_flops(relu) / DEVICE_SPEED["cpu"][0]
    assert node_seconds(relu, fused=True) < node_seconds(relu)


class _TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        e = torch.exp(h)  # read by an elementwise op only: fused away unless kept
        return self.b(torch.relu(e * h))


def test_keeping_costs_a_read_and_a_write_only_where_the_forward_would_not_write_anyway() -> None:
    """Under Inductor, keeping a value costs the backward's read of it at the device's
    bandwidth, and a value fused into its readers the forward's write too; a matrix product's
    output or input is written whether kept or not; a step input costs nothing to keep; the
    eager executor writes everything and is charged nothing."""
    x = torch.randn(8, 32)
    (jg,) = joint_graphs(_TwoLinears(), x, executor="inductor")
    (eager,) = joint_graphs(_TwoLinears(), x)
    addmm = next(n for n in jg.forward if n.target is torch.ops.aten.addmm.default)
    exp = next(n for n in jg.forward if n.target is torch.ops.aten.exp.default)
    relu = next(n for n in jg.forward if n.target is torch.ops.aten.relu.default)
    assert any(is_compute_heavy(u) for u in relu.users)  # the next Linear reads it
    one = 8 * 64 * 4 / DEVICE_SPEED["cpu"][1]  # each of the three: 8x64 fp32
    assert keeping_seconds(jg, [exp]) == pytest.approx(2 * one)
    assert keeping_seconds(jg, [addmm]) == keeping_seconds(jg, [relu]) == pytest.approx(one)
    assert keeping_seconds(jg, [exp, addmm, relu]) == pytest.approx(4 * one)
    assert keeping_seconds(jg, jg.primals) == 0.0
    eager_exp = next(n for n in eager.forward if n.target is torch.ops.aten.exp.default)
    assert keeping_seconds(eager, [eager_exp]) == 0.0


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.tanh(self.a(x))  # a residual stream: read again after ``b``, which it feeds
        g = torch.exp(s)  # read by elementwise ops only, before ``b``
        return self.b(torch.relu(s * g)) + s


def test_a_value_read_again_after_a_kernel_it_feeds_is_written_anyway() -> None:
    """A value the forward reads on both sides of a matrix product depending on it outlives the
    fused kernel that made it: written whether kept or not, so keeping it costs only its read (a
    pre-activation ResNet's residual sums); one read only before that product costs its write
    too."""
    (jg,) = joint_graphs(_Residual(), torch.randn(8, 32), executor="inductor")
    tanh = next(n for n in jg.forward if n.target is torch.ops.aten.tanh.default)
    exp = next(n for n in jg.forward if n.target is torch.ops.aten.exp.default)
    assert not any(is_compute_heavy(u) for u in tanh.users)  # not a matrix product's input
    one = 8 * 64 * 4 / DEVICE_SPEED["cpu"][1]
    assert keeping_seconds(jg, [tanh]) == pytest.approx(one)
    assert keeping_seconds(jg, [exp]) == pytest.approx(2 * one)


class _Chunked(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from memfit.nn import chunked_attention

        return chunked_attention(q, k, v, ["mul"], [None], [0.25])


def test_memfit_attention_kernels_are_heavy_and_priced() -> None:
    """The planner must see memfit's kernels as attention: heavy, with attention's FLOPs.

    So budget plans keep their small outputs (out, logsumexp) rather than recompute them.
    """
    q, k, v = (torch.randn(2, 3, 40, 8, requires_grad=True) for _ in range(3))
    (jg,) = joint_graphs(_Chunked(), q, k, v)
    fwd = [n for n in jg.forward if "chunked_attention_fwd" in str(n.target)]
    bwd = [n for n in jg.nodes if "chunked_attention_bwd" in str(n.target)]
    assert len(fwd) == 1 and len(bwd) == 1
    assert is_compute_heavy(fwd[0]) and is_compute_heavy(bwd[0])
    assert node_flops(fwd[0]) == 2 * (2 * 3) * 40 * 40 * (8 + 8)
    assert node_flops(bwd[0]) > node_flops(fwd[0])


def test_flops_of_a_symbolic_size_at_its_hint_and_at_other_sizes() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh())
    (jg,) = joint_graphs(model, torch.randn(8, 16), dynamic=True)
    (symbol,) = jg.symbols
    addmm = next(n for n in jg.forward if n.target is torch.ops.aten.addmm.default)
    tanh = next(n for n in jg.forward if n.target is torch.ops.aten.tanh.default)
    assert node_flops(addmm) == 2 * 8 * 16 * 32
    assert node_flops(addmm, Sizes({symbol: 40})) == 2 * 40 * 16 * 32
    assert node_flops(tanh, Sizes({symbol: 40})) == 40 * 32
    assert node_seconds(tanh, Sizes({symbol: 40})) == pytest.approx(5 * node_seconds(tanh))
