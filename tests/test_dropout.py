"""memfit.capture.dropout: dropouts as eager CPU runs them (identity dropouts removed, a CPU
dropout's backward with eager's rounded scale, its result made from its mask by an op a plan can
recompute).

The oracle is eager autograd through ``F.dropout`` with the same random state.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import memfit
from memfit.bench.graphs import joint_graphs
from memfit.capture.dropout import (
    eager_cpu_dropout_backward,
    recomputable_cpu_dropout,
    remove_identity_dropouts,
)

aten = torch.ops.aten


def _forward_and_backward(x: torch.Tensor, grad: torch.Tensor, p: float) -> torch.Tensor:
    _, mask = aten.native_dropout(x, p, True)
    return aten.native_dropout_backward(grad, mask, 1.0 / (1.0 - p))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("p", [0.1, 0.3, 0.7])
def test_a_cpu_dropout_backward_equals_eager_autograd(dtype: torch.dtype, p: float) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g).to(dtype)
    grad = torch.randn(4096, generator=g).to(dtype)
    joint = make_fx(lambda x, grad: _forward_and_backward(x, grad, p))(x, grad)
    assert eager_cpu_dropout_backward(joint) == 1
    targets = {n.target for n in joint.graph.nodes}
    assert aten.native_dropout_backward.default not in targets

    leaf = x.clone().requires_grad_()
    torch.manual_seed(3)
    F.dropout(leaf, p, training=True).backward(grad)
    torch.manual_seed(3)
    assert torch.equal(joint(x, grad), leaf.grad)


def test_the_backward_before_the_rewrite_is_a_rounding_step_off_in_bf16() -> None:
    """What the rewrite mends: the traced backward's unrounded scale differs from eager's."""
    g = torch.Generator().manual_seed(0)
    x, grad = (torch.randn(4096, generator=g).to(torch.bfloat16) for _ in range(2))
    leaf = x.clone().requires_grad_()
    torch.manual_seed(3)
    F.dropout(leaf, 0.1, training=True).backward(grad)
    torch.manual_seed(3)
    assert not torch.equal(_forward_and_backward(x, grad, 0.1), leaf.grad)


class _Identity(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(F.dropout(self.linear(x), p=0.0, training=True))


def test_identity_dropouts_leave_the_graph() -> None:
    model = _Identity()
    gm = torch.fx.symbolic_trace(model)
    assert remove_identity_dropouts(gm) == 1
    x = torch.randn(2, 4)
    assert torch.equal(gm(x), F.relu(model.linear(x)))


_INT = {torch.float64: torch.int64, torch.float32: torch.int32}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT.get(t.dtype, torch.int16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("p", [0.1, 0.15, 0.123, 0.5, 0.7])
def test_the_rebuilt_result_is_eager_dropouts_bit_for_bit(dtype: torch.dtype, p: float) -> None:
    """NaN (either sign), infinities and signed zeros, kept and dropped, come out as eager's; at
    p = 0.15 and 0.123 the kernel's own fp32 result is a rounding step off eager's."""
    x = (torch.randn(8192, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)
    specials = [float("nan"), -float("nan"), float("inf"), -float("inf"), -0.0, 0.0, -3.0]
    x[: 16 * len(specials)] = torch.tensor(specials, dtype=dtype).repeat(16)
    joint = make_fx(lambda x: aten.native_dropout(x, p, True)[0])(x)
    assert recomputable_cpu_dropout(joint) == 1
    targets = [n.target for n in joint.graph.nodes]
    assert torch.ops.memfit.dropout_result.default in targets

    torch.manual_seed(3)
    expected = F.dropout(x, p, training=True)
    state = torch.get_rng_state()
    torch.manual_seed(3)
    assert torch.equal(_bits(joint(x)), _bits(expected))
    assert torch.equal(torch.get_rng_state(), state)  # the generator left where eager leaves it


class _SoftmaxDropout(nn.Module):
    """A wide softmax dropped before the linear that reads it (attention probabilities' shape):
    kept, the dropped probabilities cost as much as the softmax they are made from."""

    def __init__(self, width: int = 32, p: float = 0.15) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleList([nn.Linear(width, 8 * width), nn.Linear(8 * width, width)])
            for _ in range(3)
        )
        self.p = p

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for up, down in self.layers:
            h = h + down(F.dropout(torch.softmax(up(h), -1), self.p, training=True))
        return h.square().mean()


def _x() -> torch.Tensor:
    return torch.randn(4, 64, 32, generator=torch.Generator().manual_seed(0))


def test_a_dropouts_result_can_be_recomputed_and_its_mask_is_kept() -> None:
    torch.manual_seed(0)
    (jg,) = joint_graphs(_SoftmaxDropout(), _x())
    results = [n for n in jg.forward if n.target is torch.ops.memfit.dropout_result.default]
    assert len(results) == 3
    for result in results:
        _, mask, _ = result.args
        assert not jg.never_recompute(result) and jg.never_recompute(mask)
        (kernel,) = {mask.args[0]}
        assert kernel.target is aten.native_dropout.default
        # the kernel's own result is a storage of its own, read by nothing: it dies as made
        assert not set(jg.storages[kernel][:1]) & set(jg.storages[result])


def _step(model: nn.Module) -> tuple[int, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    x = _x()
    torch.manual_seed(3)
    m = memfit.measure(lambda: model(x).backward())
    assert m.peak_bytes is not None
    return m.peak_bytes, [p.grad.clone() for p in model.parameters()]


@pytest.mark.slow
def test_memory_recomputes_dropped_probabilities_bit_for_bit() -> None:
    """``"memory"`` kept each layer's dropped probabilities, random values it could not make
    again (1,540,244 bytes, 5.9 probabilities' worth); now it keeps the bool masks and recomputes
    them (1,310,868 bytes). At p = 0.15 the traced kernel's fp32 result was also a rounding step
    off eager's, so gradients differed from plain PyTorch's; now they are equal bit for bit."""
    torch.manual_seed(0)
    model = _SoftmaxDropout()
    probabilities = 4 * 64 * 256 * 4
    _, expected = _step(model)
    memfit.checkpoint(model, "memory")
    for _ in range(2):
        peak, grads = _step(model)
        assert all(torch.equal(g, e) for g, e in zip(grads, expected))
    assert peak == model.memfit.plan.predicted_peak_bytes
    assert peak < 5.5 * probabilities
