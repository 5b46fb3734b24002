"""memfit.execution.eager_paths: a model that runs other code when compiled runs, under memfit,
the code plain PyTorch runs; the model's flags are as the user set them after each call."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import memfit
from memfit.execution.eager_paths import compile_only_switches, eager_paths


class _Scan(nn.Module):
    """Mamba's shape: a cumulative product by a loop in eager, another algorithm when compiled
    (here one that keeps an extra copy and rounds differently, so the two are told apart)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.use_associative_scan = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        if self.use_associative_scan and torch.compiler.is_compiling():
            return torch.cumsum(h * 1.0001, dim=1)
        outs, state = [], torch.zeros_like(h[:, 0])
        for i in range(h.shape[1]):
            state = state + h[:, i]
            outs.append(state)
        return torch.stack(outs, dim=1)


def test_switches_are_found_and_put_back() -> None:
    model = nn.Sequential(_Scan(), nn.ReLU())
    switches = compile_only_switches(model)
    assert switches == [(model[0], "use_associative_scan")]
    with eager_paths(switches):
        assert model[0].use_associative_scan is False
    assert model[0].use_associative_scan is True


def test_a_model_with_no_switch_has_none() -> None:
    assert compile_only_switches(nn.Linear(2, 2)) == []


@pytest.mark.parametrize("policy", ["none", "memory"])
def test_memfit_runs_the_eager_path_plain_pytorch_runs(policy: str) -> None:
    torch.manual_seed(0)
    model = _Scan()
    x = torch.randn(2, 6, 8)
    expected_out = model(x)
    expected_out.square().sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    memfit.checkpoint(model, policy)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        out = model(x)
        assert torch.equal(out, expected_out)
        out.square().sum().backward()
        assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected))
        assert model.use_associative_scan is True
