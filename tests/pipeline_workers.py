"""What each rank runs in the multi-process pipeline tests (spawned processes import this)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch

import memfit
from memfit.pipeline import Pipeline
from pipeline_models import build

#: each rank's generator is seeded with this plus its rank before the first step
SEED = 100


def train(
    rank: int,
    name: str,
    stages: int,
    microbatches: int,
    schedules: tuple[str, ...] = ("gpipe", "1f1b"),
    budget: int | None = None,
) -> dict[str, dict[str, Any]]:
    """Per schedule, on a fresh model: plan, one step; report cuts, loss, gradients, buffers."""
    out = {}
    for schedule in schedules:
        model, x, target, loss_fn = build(name)
        pipe = Pipeline(
            model,
            x,
            loss_fn,
            stages=stages,
            microbatches=microbatches,
            schedule=schedule,
            budget=budget,
        )
        torch.manual_seed(SEED + rank)
        loss = pipe.step(x, target=target).item()
        out[schedule] = {
            "start": pipe.graph.start,
            "loss": loss,
            "grads": {n: p.grad.detach().clone() for n, p in pipe.named_parameters()},
            "buffers": {n: b.detach().clone() for n, b in pipe.module.named_buffers()},
        }
    return out


def measured_peak(
    rank: int, name: str, stages: int, microbatches: int, schedule: str, budget: int | None
) -> Any:
    """Predicted and measured peak of a step (after a first step that compiles)."""
    model, x, target, loss_fn = build(name)
    pipe = Pipeline(
        model,
        x,
        loss_fn,
        stages=stages,
        microbatches=microbatches,
        schedule=schedule,
        budget=budget,
    )
    pipe.step(x, target=target)
    for p in pipe.parameters():
        p.grad = None
    measured = memfit.measure(lambda: pipe.step(x, target=target))
    return pipe.plan, measured.peak_bytes


def dies(rank: int, name: str, stages: int) -> None:
    """Rank 1 is killed (as by the OOM killer) when the others are in the middle of a step."""
    model, x, target, loss_fn = build(name)
    pipe = Pipeline(model, x, loss_fn, stages=stages, microbatches=4)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    pipe.step(x, target=target)


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
