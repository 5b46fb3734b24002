"""``benchmarks/max_batch.py``: every method trains the same model (the same loss and gradients as
plain PyTorch), and a method's largest batch is one whose whole step was measured within plain's
memory at ``b0`` while the next one up was measured over it.

The script is not part of the package: imported with ``benchmarks/`` on the path, as it imports
its sibling ``offload`` (the ResNet-50-like network).
"""

from __future__ import annotations

import argparse
import importlib
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from clitools import ROOT


@pytest.fixture
def mb(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("max_batch")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


def _spec(mb: ModuleType) -> Any:
    """An 8-block residual MLP, as the benchmark's model spec (b0 = 8 rows)."""

    def batch(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        return torch.randn(n, 32, generator=g).to(device), torch.randint(0, 32, (n,), generator=g)

    return mb.Spec(
        "mlp",
        "residual MLP",
        lambda: nn.Sequential(*[Block() for _ in range(8)]),
        batch,
        mb._classify,
        Block,
        8,
    )


def _args(mb: ModuleType, *methods: str) -> argparse.Namespace:
    return mb.parse_args(
        ["--quick", "--rounds", "1", "--limit", "4", "--methods", ",".join(methods)]
    )


def test_timed_batches_run_from_b0_to_the_largest(mb: ModuleType) -> None:
    assert mb.timed_batches(4, 40, quick=False) == [4, 8, 16, 32, 40]
    assert mb.timed_batches(4, 32, quick=False) == [4, 8, 16, 32]
    assert mb.timed_batches(4, 40, quick=True) == [4, 40]
    assert mb.timed_batches(4, 4, quick=False) == [4]
    # a method whose largest batch is below b0 is timed at b0 and at its largest
    assert mb.timed_batches(8, 4, quick=False) == [4, 8]


@pytest.mark.parametrize(
    "method",
    ["per-block checkpoint", "save_on_cpu", pytest.param("memfit budget", marks=pytest.mark.slow)],
)
def test_each_method_computes_plain_pytorchs_loss_and_gradients(
    mb: ModuleType, method: str
) -> None:
    spec, args = _spec(mb), _args(mb, "plain", method)
    device = torch.device("cpu")
    batch = spec.make_batch(8, device)
    plain = mb.make_runnable(spec, "plain", device, args, "test_plain")
    other = mb.make_runnable(spec, method, device, args, f"test_{method}", room=2**30)
    for run in (plain, other):
        run.model.zero_grad(set_to_none=True)
        run.run(batch)
    for (name, p), q in zip(plain.model.named_parameters(), other.model.parameters()):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, msg=lambda m, name=name: f"{name}: {m}")
    loss = F.cross_entropy(plain.model(batch[0]), batch[1])
    torch.testing.assert_close(mb._classify(other.model, batch), loss)


@pytest.mark.slow
def test_a_largest_batch_fits_the_budget_and_the_next_one_up_does_not(mb: ModuleType) -> None:
    spec = _spec(mb)
    args = _args(mb, "plain", "per-block checkpoint", "memfit memory")
    result = mb.run_model(spec, args)
    budget = result["budget_bytes"]
    assert budget == result["weights_bytes"] + result["batch_bytes_b0"] + result["plain_peak_b0"]
    by_method = {r["method"]: r for r in result["results"]}
    assert by_method["plain"]["batch"] >= spec.b0
    for r in result["results"]:
        probes = {p["batch"]: p for p in r["probes"]}
        if r["batch"]:
            assert probes[r["batch"]]["fits"] and probes[r["batch"]]["total_bytes"] <= budget
            at = r["at_largest"]
            assert at["total_bytes"] <= budget and at["within_budget"], r["method"]
            assert at["time_per_sample_vs_plain_b0"] > 0
        if not r["capped"]:
            over = probes[r["first_not_fitting"]]
            assert not over["fits"]
            assert over["total_bytes"] is None or over["total_bytes"] > budget
            assert r["first_not_fitting"] - r["batch"] == spec.b0 // 2 or r["batch"] == 0
