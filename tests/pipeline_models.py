"""Small models the pipeline tests cut into stages (importable by spawned rank processes)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, width: int = 32, depth: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


class Block(nn.Module):
    def __init__(self, d: int, heads: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / (d // self.heads) ** 0.5
        att = self.drop(att.softmax(-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class TinyGPT(nn.Module):
    """Embedding tied to the LM head (a parameter two stages read), pre-norm blocks."""

    def __init__(self, vocab: int = 40, d: int = 16, depth: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(8, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, dropout=dropout) for _ in range(depth))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class LongSkip(nn.Module):
    """A value from the first layer read by the last: relayed through every stage between."""

    def __init__(self, width: int = 24, depth: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.bn = nn.BatchNorm1d(width)
        self.drop = nn.Dropout(0.25)
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = torch.relu(self.inp(x))
        h = first
        for i, layer in enumerate(self.layers):
            h = torch.relu(layer(h))
            if i == 1:
                h = self.drop(self.bn(h))
        return self.out(h + first)


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def lm_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def build(name: str, seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor, object]:
    """A model, a mini-batch (of 8; "wide": 1024, each activation of a micro-batch of 256 then
    64 KiB) and its target, and the loss, all from ``seed``."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    if name == "mlp":
        return MLP(), torch.randn(8, 32, generator=gen), torch.randn(8, 4, generator=gen), mse
    if name == "wide":
        x, target = torch.randn(1024, 64, generator=gen), torch.randn(1024, 4, generator=gen)
        return MLP(width=64, depth=8), x, target, mse
    if name == "gpt":
        model = TinyGPT()
        idx = torch.randint(0, 40, (8, 8), generator=gen)
        return model, idx, torch.randint(0, 40, (8, 8), generator=gen), lm_loss
    if name == "skip":
        return LongSkip(), torch.randn(8, 24, generator=gen), torch.randn(8, 3, generator=gen), mse
    raise ValueError(name)
