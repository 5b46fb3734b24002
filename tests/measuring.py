"""Sizes and small workloads shared by the measurement tests (memfit.measurement)."""

from __future__ import annotations

import torch

MB = 1_000_000
FLOATS_PER_MB = MB // 4


def kept_intermediates(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    """A forward that keeps n intermediate tensors, each the size of x."""
    kept = []
    h = x
    for _ in range(n):
        h = torch.tanh(h)
        kept.append(h)
    return kept


def mlp_step(model: torch.nn.Module, x: torch.Tensor) -> None:
    model(x).square().mean().backward()


def small_mlp(device: str = "cpu") -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(256, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 1),
    ).to(device)
