"""How deep a model fits a fixed per-device budget: one device against K pipeline stages.

A stack of residual feed-forward blocks (width 128, hidden 512, 32 sequences of 32 tokens,
trained with Adam: parameters, gradients and two moments, 16 bytes per parameter) is made
deeper until it no longer fits ``--budget`` bytes per device:

* ``plain``: one device, plain PyTorch: the model's state plus a training step's measured peak
  (``memfit.measure``, exact tensor accounting on CPU);
* ``memfit``: one device, ``memfit.checkpoint(model, budget - state)``: fits when the
  planner finds a plan (its prediction, then checked by measuring the step);
* ``pipeline K=2``, ``K=4``: ``memfit.pipeline.plan(..., ranks=K,
  options=PipelineOptions(microbatches=4, budget=budget, optimizer_state=2))`` finds a split
  (every stage's predicted peak within the budget); at the deepest such model the pipeline is
  run in K local processes (gloo) and each stage's measured step peak plus its state and buffers
  is checked against the budget.

The deepest fitting depth is found by doubling and bisection. Writes
``benchmarks/results/pipeline_depth.{json,md}`` (``--quick``: a smaller budget and ``_quick``
files).
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import memfit
from memfit.bench.environment import load_average, machine_info, software_info
from memfit.pipeline import Pipeline, PipelineOptions, launch
from memfit.pipeline import plan as pipeline_plan
from memfit.units import format_bytes

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

WIDTH, HIDDEN, BATCH, TOKENS, MICROBATCHES = 128, 512, 32, 32, 4
ADAM_STATE = 2.0  # exp_avg and exp_avg_sq per parameter byte


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.head = nn.Linear(WIDTH, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make(depth: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.compiler.reset()  # every depth is a new model: Dynamo would hit its recompile limit
    torch.manual_seed(0)
    return Stack(depth), torch.randn(BATCH, TOKENS, WIDTH), torch.randn(BATCH, TOKENS, 8)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def static_bytes(model: nn.Module) -> int:
    """Held between steps: parameters and Adam's two moments (gradients are made in a step)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return int(params * (1 + ADAM_STATE))


def plain_fits(depth: int, budget: int) -> tuple[bool, dict[str, Any]]:
    model, x, t = make(depth)
    step = memfit.measure(lambda: loss_fn(model(x), t).backward())
    total = static_bytes(model) + (step.peak_bytes or 0)
    return total <= budget, {"measured_total_bytes": total}


def memfit_fits(depth: int, budget: int) -> tuple[bool, dict[str, Any]]:
    model, x, t = make(depth)
    activations = budget - static_bytes(model)
    if activations <= 0:
        return False, {"reason": "parameters and optimizer state alone exceed the budget"}
    wrapped = memfit.checkpoint(model, activations)
    try:
        loss_fn(wrapped(x), t).backward()  # plans (and compiles) on the first call
    except memfit.BudgetError as err:
        return False, {"reason": str(err).splitlines()[0]}
    for p in model.parameters():
        p.grad = None
    measured = memfit.measure(lambda: loss_fn(wrapped(x), t).backward())
    total = static_bytes(model) + (measured.peak_bytes or 0)
    return total <= budget, {
        "predicted_total_bytes": static_bytes(model) + wrapped.memfit.plan.predicted_peak_bytes,
        "measured_total_bytes": total,
    }


def pipeline_fits(depth: int, budget: int, ranks: int) -> tuple[bool, dict[str, Any]]:
    model, x, t = make(depth)
    try:
        planned = pipeline_plan(
            model,
            x,
            loss_fn,
            ranks=ranks,
            options=PipelineOptions(
                microbatches=MICROBATCHES, budget=budget, optimizer_state=ADAM_STATE
            ),
        )
    except (memfit.BudgetError, ValueError) as err:
        return False, {"reason": str(err).splitlines()[0]}
    return True, {
        "predicted_peak_bytes": [s.peak_bytes for s in planned.stages],
        "cuts": list(planned.cuts),
    }


def _rank(rank: int, depth: int, budget: int, ranks: int) -> dict[str, Any]:
    model, x, t = make(depth)
    pipe = Pipeline(
        model,
        x,
        loss_fn,
        ranks=ranks,
        options=PipelineOptions(
            microbatches=MICROBATCHES, budget=budget, optimizer_state=ADAM_STATE
        ),
    )
    pipe.step(x, target=t)
    for p in pipe.parameters():
        p.grad = None
    measured = memfit.measure(lambda: pipe.step(x, target=t))
    plan = pipe.plan
    held = plan.parameter_bytes + plan.buffer_bytes + plan.optimizer_bytes + plan.buffers_bytes
    return {
        "stage": rank,
        "predicted_peak_bytes": plan.peak_bytes,
        "measured_peak_bytes": held + (measured.peak_bytes or 0),
        "predicted_step_peak_bytes": plan.step_peak_bytes,
        "measured_step_peak_bytes": measured.peak_bytes,
    }


def deepest(fits: Callable[[int], tuple[bool, dict[str, Any]]], limit: int) -> dict[str, Any]:
    """The largest depth ``fits`` accepts (doubling, then bisection), with its details."""
    good: tuple[int, dict[str, Any]] | None = None
    depth = 1
    tried: dict[int, bool] = {}
    while depth <= limit:
        ok, info = fits(depth)
        tried[depth] = ok
        if not ok:
            break
        good = (depth, info)
        depth *= 2
    if good is None:
        return {"depth": 0, "tried": tried}
    low, high = good[0], min(depth, limit + 1)
    while high - low > 1:
        mid = (low + high) // 2
        ok, info = fits(mid)
        tried[mid] = ok
        if ok:
            low, good = mid, (mid, info)
        else:
            high = mid
    return {"depth": good[0], "details": good[1], "tried": tried}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 12 MiB budget, K = 2 only")
    parser.add_argument("--budget", type=int, default=None, help="bytes per device (32 MiB)")
    parser.add_argument("--limit", type=int, default=64, help="deepest model tried")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    budget = args.budget or (12 if args.quick else 32) * 2**20
    ks = (2,) if args.quick else (2, 4)
    started = time.perf_counter()
    rows: dict[str, Any] = {
        "plain": deepest(lambda d: plain_fits(d, budget), args.limit),
        "memfit": deepest(lambda d: memfit_fits(d, budget), args.limit),
    }
    for k in ks:
        found = deepest(lambda d, k=k: pipeline_fits(d, budget, k), args.limit)
        if found["depth"]:
            found["run"] = launch(_rank, k, args=(found["depth"], budget, k), timeout=600)
            found["fits_measured"] = all(r["measured_peak_bytes"] <= budget for r in found["run"])
        rows[f"pipeline K={k}"] = found
    result = {
        "benchmark": "pipeline_depth",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "software": software_info(ROOT),
        "load_average": load_average(),
        "budget_bytes": budget,
        "model": {
            "width": WIDTH,
            "hidden": HIDDEN,
            "batch": BATCH,
            "tokens": TOKENS,
            "microbatches": MICROBATCHES,
            "optimizer_state_per_param_byte": ADAM_STATE,
        },
        "rows": rows,
        "seconds": round(time.perf_counter() - started, 1),
    }
    stem = "pipeline_depth_quick" if args.quick else "pipeline_depth"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    lines = [
        f"# Deepest model within {format_bytes(budget)} per device",
        "",
        f"Residual FFN blocks (width {WIDTH}, hidden {HIDDEN}), batch {BATCH}x{TOKENS}, Adam "
        f"state; pipeline with {MICROBATCHES} micro-batches (GPipe). {result['date']}, torch "
        f"{result['software']['torch']}, {result['machine'].get('cpu_model', '?')}.",
        "",
        "| setting | deepest | per-device peak at that depth (measured) |",
        "|---|---:|---|",
    ]
    for name, row in rows.items():
        if "run" in row:
            peaks = ", ".join(
                f"{format_bytes(r['measured_peak_bytes'])} (pred. "
                f"{format_bytes(r['predicted_peak_bytes'])})"
                for r in row["run"]
            )
        else:
            details = row.get("details", {})
            peaks = format_bytes(details.get("measured_total_bytes", 0)) if details else "-"
        lines.append(f"| {name} | {row['depth']} | {peaks} |")
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))  # noqa: T201
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
