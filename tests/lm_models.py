"""A small language model whose loss (cross-entropy over its vocabulary) is much of its step:
the case where a loss outside memfit's graphs matters (``test_step.py``,
``test_planned_call.py``)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 2000


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 256)
        self.layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(8))
        self.head = nn.Linear(256, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (16, 64), generator=g), torch.randint(
        0, VOCAB, (16, 64), generator=g
    )


def lm() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())
