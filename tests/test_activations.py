"""Saved activations by submodule: exact bytes, credited to the module that made them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memfit.cli.steps import default_loss
from memfit.measurement.activations import LOSS, saved_activations


class Block(nn.Module):
    """A functional ReLU in the block's own code, between two Linear children."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 64)
        self.b = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.relu(self.a(x)))


def by_module(acts) -> dict[str, tuple[int, int]]:
    return {m.module: (m.self_bytes, m.total_bytes) for m in acts.modules}


def test_mlp_saves_exactly_the_tanh_outputs() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    acts = saved_activations(model, (torch.randn(5, 16),), {}, default_loss)
    assert acts.total_bytes == 5 * 32 * 4  # weights and the input are not activations
    assert by_module(acts) == {"1": (640, 640), "": (0, 640)}
    (t,) = acts.tensors
    assert t.shape == (5, 32) and t.module == "1"
    assert set(t.saved_by) == {"TanhBackward0", "AddmmBackward0"}
    assert all(p.grad is None for p in model.parameters())  # the step cleans up after itself


def test_functional_ops_count_for_the_module_whose_code_runs_them() -> None:
    model = nn.Sequential(Block(), Block())
    x = torch.randn(4, 8)
    acts = saved_activations(model, (x,), {}, lambda out: F.mse_loss(out, torch.zeros_like(out)))
    relu_out, block_out = 4 * 64 * 4, 4 * 8 * 4
    table = by_module(acts)
    # ReLU's output (saved by ReluBackward and by b's matmul) is the block's own; a's output is
    # not saved (ReLU saves its result); block 0's output is saved by block 1's first matmul.
    assert table["0"] == (relu_out, relu_out + block_out)
    assert table["0.b"] == (block_out, block_out)
    assert table["1"][0] == relu_out
    assert "0.a" not in table
    # mse_loss saves its input, the model's output, made by the last Linear
    assert table["1.b"] == (block_out, block_out)
    assert LOSS not in table or table[LOSS][0] >= 0
    assert acts.total_bytes == sum(s for s, _ in table.values())


def test_a_tensor_saved_by_several_ops_counts_once() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.lin(x))  # saved by TanhBackward (its output) and MulBackward
            return (h * h).sum() + h.exp().sum()  # exp saves its own output: a second storage

    acts = saved_activations(Twice(), (torch.randn(8, 8),), {}, default_loss)
    assert acts.total_bytes == 2 * 8 * 8 * 4
    readers = sorted(set(t.saved_by) for t in acts.tensors)
    assert {"TanhBackward0", "MulBackward0"} in [set(r) for r in readers]
    assert all(t.module == "" for t in acts.tensors)  # made by Twice's own code
