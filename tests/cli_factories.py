"""Factories ``memfit profile`` loads in the CLI tests: tiny models, and ones that go wrong.

Loaded by path (``tests/cli_factories.py:tiny_mlp``), as a user's own file would be.
"""

from __future__ import annotations

import os

import torch
from torch import nn


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 10)
    )


def tiny_mlp() -> tuple[nn.Module, torch.Tensor]:
    """(model, example_inputs): a 3-layer MLP, batch 16; about 40 KiB of weights."""
    return _mlp(), torch.randn(16, 32)


def tiny_mlp_model() -> nn.Module:
    """Only the model, for --input-shape."""
    return _mlp()


def raises() -> nn.Module:
    raise RuntimeError("factory failed on purpose")


def raises_with_omp_policy() -> nn.Module:
    raise RuntimeError(f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}")


NOT_CALLABLE = 3
