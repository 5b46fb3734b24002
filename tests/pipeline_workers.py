"""What each rank runs in the multi-process pipeline tests (spawned processes import this)."""

from __future__ import annotations

import time

import torch


def summed(rank: int) -> dict[str, torch.Tensor]:
    """An all-reduce across ranks: the launch's process group works; tensors come back."""
    value = torch.full((3,), float(rank + 1))
    torch.distributed.all_reduce(value)
    return {"rank": torch.tensor(rank), "sum": value}


def raises_on_rank_one(rank: int) -> None:
    """Rank 1 raises; the others wait for a message from it that never comes."""
    if rank == 1:
        raise ValueError("boom")
    torch.distributed.recv(torch.empty(1), src=1)


def sleeps(rank: int) -> None:
    """Every rank hangs."""
    time.sleep(3600)
