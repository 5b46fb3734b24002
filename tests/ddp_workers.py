"""What each rank runs in the DDP tests (spawned processes import this)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import memfit


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(256, 256), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(256, 4))


def _batches(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    return [torch.randn(8, 256, generator=g) for _ in range(3)]


def accumulate(rank: int, policies: tuple[str | None, ...]) -> dict[str | None, Any]:
    """``_accumulate`` with each policy in turn, in one process group."""
    return {policy: _accumulate(rank, policy) for policy in policies}


def _accumulate(rank: int, policy: str | None) -> dict[str, Any]:
    """Two optimizer steps of DDP with gradient accumulation: two micro-batches under
    ``no_sync`` and a third synchronised; ``policy=None`` is plain DDP. Reports the gradients
    after each step and the peak of each accumulating micro-batch of the second step."""
    model = _mlp()
    inner = model if policy is None else memfit.checkpoint(model, policy)
    ddp = DDP(inner)
    out: dict[str, Any] = {"grads": [], "peaks": []}
    for step in range(2):
        first, second, last = _batches(rank + 2 * step)
        with ddp.no_sync():
            ddp(first).square().mean().backward()
            if step == 1:  # .grad exists: this micro-batch accumulates into it
                m = memfit.measure(lambda x=second: ddp(x).square().mean().backward())
                out["peaks"].append(m.peak_bytes)
            else:
                ddp(second).square().mean().backward()
        ddp(last).square().mean().backward()
        out["grads"].append([p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=step == 0)  # the second step starts from zeroed tensors
    return out
