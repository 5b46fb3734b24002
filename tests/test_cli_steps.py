"""``memfit.cli.steps``: plain PyTorch's step, measured, is what the command line quotes
memfit's savings against."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memfit
from memfit.cli.steps import Workload, plain_peak_bytes
from memfit.cli.tables import policy_table


def _mlp(depth: int = 6) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(depth)])


def test_plain_peak_is_the_eager_steps_measured_peak_and_leaves_no_gradient() -> None:
    model, x = _mlp(), torch.randn(32, 64)
    got = plain_peak_bytes(Workload(model, (x,)), torch.device("cpu"))
    assert all(p.grad is None for p in model.parameters())
    expected = memfit.measure(lambda: model(x).sum().float().backward()).peak_bytes
    assert got == expected
    assert not hasattr(model, "memfit")  # measured as written, memfit not applied


@pytest.mark.slow
def test_the_policy_table_quotes_peaks_against_plain_with_none_beside() -> None:
    from memfit.cli.steps import run_policies
    from memfit.planning.policy import Policy

    model, x = _mlp(16), torch.randn(512, 64)  # activations well above the weights' gradients
    work = Workload(model, (x,))
    plain = plain_peak_bytes(work, torch.device("cpu"))
    results = run_policies(work, [Policy("none"), Policy("memory")], torch.device("cpu"), 1)
    table = policy_table(results, "t", plain_peak_bytes=plain)
    headers = [c.header for c in table.columns]
    assert headers[:4] == ["policy", "measured peak", "vs plain", "vs none"]
    rows = list(zip(*[list(c.cells) for c in table.columns]))
    assert rows[0][0] == "plain PyTorch" and rows[0][2] == "1.00x"
    memory = next(r for r in rows if r[0] == "memory")
    ratio = results[1].peak_bytes / plain
    assert memory[2] == f"{ratio:.2f}x" and ratio < 1
    assert [c.header for c in policy_table(results, "t").columns][2] == "vs none"
