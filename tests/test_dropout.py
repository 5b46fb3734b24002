"""memfit.capture.dropout: dropouts as eager CPU runs them (identity dropouts removed, a CPU
dropout's backward with eager's rounded scale).

The oracle is eager autograd through ``F.dropout`` with the same random state.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from memfit.capture.dropout import eager_cpu_dropout_backward, remove_identity_dropouts

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
