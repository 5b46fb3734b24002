"""What each rank runs in the multi-process pipeline tests (spawned processes import this)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import torch

import memfit
import memfit.pipeline.cut_search
import memfit.pipeline.runtime
from memfit.pipeline import Pipeline, PipelineOptions, StagePlan
from pipeline_models import build

#: each rank's generator is seeded with this plus its rank before the first step
SEED = 100


def _fresh(
    name: str, ranks: int, microbatches: int, schedule: str, budget: int | None
) -> tuple[Pipeline, torch.Tensor, torch.Tensor]:
    """A pipeline of a fresh model ``name`` (Dynamo reset: its recompile limit is per process),
    with its batch and target; ``"auto"`` chooses among two stages per rank."""
    torch.compiler.reset()
    model, x, target, loss_fn = build(name)
    pipe = Pipeline(
        model,
        x,
        loss_fn,
        ranks=ranks,
        options=PipelineOptions(
            microbatches=microbatches,
            schedule=schedule,
            budget=budget,
            stages_per_rank=2 if schedule == "auto" else None,
        ),
    )
    return pipe, x, target


def train(
    rank: int,
    name: str,
    ranks: int,
    microbatches: int,
    schedules: tuple[str, ...] = ("gpipe", "1f1b"),
    budget: int | None = None,
) -> dict[str, dict[str, Any]]:
    """Per schedule, on a fresh model: plan, one step; report cuts, loss, gradients, buffers."""
    out = {}
    for schedule in schedules:
        pipe, x, target = _fresh(name, ranks, microbatches, schedule, budget)
        torch.manual_seed(SEED + rank)
        loss = pipe.step(x, target=target).item()
        out[schedule] = {
            "schedule": pipe.schedule_name.value,
            "start": pipe.graph.start,
            "starts": {s: g.start for s, g in zip(pipe.local_stages, pipe.graphs)},
            "loss": loss,
            "grads": {n: p.grad.detach().clone() for n, p in pipe.named_parameters()},
            "buffers": {n: b.detach().clone() for m in pipe.modules for n, b in m.named_buffers()},
        }
    return out


#: one measured step: the schedule, the cuts to force (None: the search's own) and the budget
Job = tuple[str, tuple[int, ...] | None, int | None]


@contextlib.contextmanager
def forced_cuts(cuts: tuple[int, ...] | None) -> Iterator[None]:
    """``plan`` and ``Pipeline`` cut at ``cuts`` instead of where the search would.

    The search's cut follows profiled times, so it moves with the machine's load; a test that
    checks predictions at given cuts forces them (None: leaves the search alone).
    """
    if cuts is None:
        yield
        return
    modules = (memfit.pipeline.cut_search, memfit.pipeline.runtime)
    saved = [m.choose_cuts for m in modules]
    for m in modules:
        m.choose_cuts = lambda *args, **kwargs: list(cuts)
    try:
        yield
    finally:
        for m, f in zip(modules, saved):
            m.choose_cuts = f


def measured_peaks(
    rank: int, name: str, ranks: int, microbatches: int, jobs: tuple[Job, ...]
) -> list[tuple[StagePlan, int, int]]:
    """Per job, on a fresh model: this rank's (first) stage plan, the measured peak of a step
    (after a first step that compiles) and the rank's predicted one."""
    out = []
    for schedule, cuts, budget in jobs:
        with forced_cuts(cuts):
            pipe, x, target = _fresh(name, ranks, microbatches, schedule, budget)
        pipe.step(x, target=target)
        for p in pipe.parameters():
            p.grad = None
        measured = memfit.measure(pipe.step, x, target=target)
        out.append((pipe.plan, measured.peak_bytes, pipe.predicted_step_peak_bytes))
    return out


def trains_and_measures(
    rank: int, schedules: tuple[str, ...], cuts: tuple[int, ...], budgeted: Job
) -> dict[str, Any]:
    """Two ranks, per schedule and for ``"auto"``: a step of the skip model (``train``); per
    schedule, a measured step of the wide MLP cut at ``cuts``, and under the ``budgeted`` job
    (``measured_peaks``); in one launch."""
    jobs = tuple((schedule, cuts, None) for schedule in schedules)
    return {
        "train": train(rank, "skip", 2, 4, (*schedules, "auto")),
        "peaks": measured_peaks(rank, "wide", 2, 4, jobs),
        "budget": measured_peaks(rank, "wide", 2, 4, (budgeted,))[0],
    }


def one_step(rank: int, name: str, ranks: int) -> float:
    """One step of a GPipe pipeline of ``name`` over two micro-batches; its loss."""
    model, x, target, loss_fn = build(name)
    pipe = Pipeline(model, x, loss_fn, ranks=ranks, options=PipelineOptions(microbatches=2))
    return pipe.step(x, target=target).item()


def dies(rank: int, name: str, ranks: int) -> None:
    """Rank 1 is killed (as by the OOM killer) when the others are in the middle of a step."""
    model, x, target, loss_fn = build(name)
    pipe = Pipeline(model, x, loss_fn, ranks=ranks, options=PipelineOptions(microbatches=4))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    pipe.step(x, target=target)


def summed(rank: int) -> dict[str, torch.Tensor]:
    """An all-reduce across ranks: the launch's process group works; tensors come back."""
    value = torch.full((3,), float(rank + 1))
    torch.distributed.all_reduce(value)
    return {"rank": torch.tensor(rank), "sum": value, "threads": torch.get_num_threads()}


def raises_on_rank_one(rank: int) -> None:
    """Rank 1 raises; the others wait for a message from it that never comes."""
    if rank == 1:
        raise ValueError("boom")
    torch.distributed.recv(torch.empty(1), src=1)


def locks_and_sleeps(rank: int) -> None:
    """Rank 1 raises; the others make a multiprocessing lock (a named semaphore) and hang."""
    if rank == 1:
        time.sleep(0.5)
        raise ValueError("boom")
    with multiprocessing.get_context("spawn").Lock():
        time.sleep(3600)


def sleeps(rank: int) -> None:
    """Every rank hangs."""
    time.sleep(3600)
