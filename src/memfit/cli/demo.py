"""``memfit demo`` (what ``make demo`` runs): what memfit does, on one model in under a minute.

Why this exists: a new user's first question is "how much memory does this save, and what does it
cost?". The honest answer is a measurement, not a prediction, so the demo trains one step of a
CIFAR-shaped ResNet (``memfit.bench.resnet``: pre-activation ResNet v2 with BatchNorm, the kind
of model gradient checkpointing is usually sold on) under each policy (``none``, ``speed``,
``memory``, a budget of half of the activations plain autograd keeps, and on CUDA ``swap``, which
offloads to host memory behind compute) and reports side by side:

* the **measured** peak tensor memory of one training step (``memfit.measure``: exact allocator
  accounting on CPU, allocator statistics on CUDA), and its ratio to ``"none"`` (keep everything);
* memfit's **predicted** peak for the same step (``model.memfit.plan.predicted_peak_bytes``), so
  the planner's model can be checked against reality;
* the step time (median of 3, measured without the memory profiler, which inflates CPU time), its
  ratio to ``"none"``, and the FLOPs memfit recomputes, as a fraction of one forward.

It writes one figure: live tensor memory over one step per policy (forward/backward boundary
marked), and peak memory per policy, to ``--out`` (default ``memfit-demo`` in the temporary
directory: a demo leaves the working directory as it found it) and prints where it went. It
runs on CUDA if available, else on CPU; the measuring is
``memfit.cli.steps``, the figure ``memfit.cli.figures``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from torch import nn

from memfit.bench.resnet import cifar_resnet
from memfit.cli.arguments import Command
from memfit.cli.figures import timeline_figure
from memfit.cli.steps import Workload, plain_peak_bytes, run_policies
from memfit.cli.tables import duration, policy_table
from memfit.planning.budget import Budget
from memfit.planning.policy import BUDGET, Policy

__all__ = ["add_parser", "run", "demo_policies", "FULL", "QUICK"]


@dataclass(frozen=True)
class Config:
    blocks_per_stage: int
    width: int
    batch: int
    timing_runs: int = 3
    budget: float = 0.5  # of the activations plain autograd keeps


FULL = Config(blocks_per_stage=5, width=16, batch=32)  # ResNet-32, 15 residual blocks
# ResNet-14: too shallow for memfit to reach half of plain autograd, so a looser budget.
QUICK = Config(blocks_per_stage=2, width=8, batch=8, timing_runs=2, budget=0.8)

#: Where the figure goes without ``--out``: outside the working tree.
DEFAULT_OUT = Path(tempfile.gettempdir()) / "memfit-demo"

EXAMPLES = f"""\
examples:
  memfit demo                 # about 20 s on 2 CPU cores; writes {DEFAULT_OUT / "demo.png"}
  memfit demo --out figures   # the figure goes to figures/demo.png
"""

COMMAND = Command(
    "demo",
    help="one training step per policy on a ResNet: table and figure",
    description="Train one step of a CIFAR ResNet-32 under each memfit policy; print "
    "measured peak memory and step time per policy and write a figure of memory over the "
    "step.",
    examples=EXAMPLES,
)


def demo_policies(budget: float = 0.5, device: torch.device | None = None) -> list[Policy]:
    """``none`` (the baseline), ``speed``, ``memory``, a budget (fraction of ``none``) and, on
    CUDA, ``swap`` (offload to host memory, hidden behind compute). On a CPU there is no copy
    engine to hide a copy behind compute, so ``swap`` offloads nothing there: showing it would
    show a policy that does nothing."""
    policies = [
        *(Policy(name) for name in ("none", "speed", "memory")),
        Policy(BUDGET, budget=Budget(fraction=budget)),
    ]
    if device is not None and device.type == "cuda":
        policies.append(Policy("swap"))
    return policies


class _WithLoss(nn.Module):
    """The model and its loss as one module, as HF models given labels are: memfit then plans
    the loss with the model, and the prediction covers the whole step from the first call."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(x), y)


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = COMMAND.add_to(sub, parents)
    p.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        metavar="DIR",
        help=f"directory for demo.png (default: {DEFAULT_OUT}, in the temporary "
        "directory, so nothing is written to the working directory)",
    )
    p.add_argument(
        "--quick", action="store_true", help="a tiny model and fewer timing runs (for tests)"
    )
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace, console: Any) -> int:
    cfg = QUICK if args.quick else FULL
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n_blocks = 3 * cfg.blocks_per_stage
    title = (
        f"ResNet-{6 * cfg.blocks_per_stage + 2} ({n_blocks} residual blocks, width "
        f"{cfg.width}), batch {cfg.batch}x3x32x32, one training step on {device.type}"
    )
    console.print(f"[bold]memfit demo[/bold]: {title}")
    console.print(
        "Each policy: one first step (capture, plan, compile), one step measured for "
        f"memory, then {cfg.timing_runs} timed steps, taken in turn across the policies"
        + (
            f" ({torch.get_num_threads()} threads, OMP_WAIT_POLICY="
            f"{os.environ.get('OMP_WAIT_POLICY', 'unset')})."
            if device.type == "cpu"
            else "."
        )
    )

    started = time.perf_counter()
    torch.manual_seed(0)
    model = _WithLoss(cifar_resnet(cfg.blocks_per_stage, cfg.width)).to(device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(cfg.batch, 3, 32, 32, generator=gen).to(device)
    y = torch.randint(0, 10, (cfg.batch,), generator=gen).to(device)
    work = Workload(model, (x, y))
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        plain = plain_peak_bytes(work, device)
        results = run_policies(
            work, demo_policies(cfg.budget, device), device, cfg.timing_runs, progress
        )
    title = "one training step (forward + loss + backward)"
    console.print(policy_table(results, title=title, plain_peak_bytes=plain))
    for r in results:
        if r.recaptured:
            console.print(
                f"[yellow]warning: {r.label} was captured again while being measured; "
                "its numbers include a recompilation[/yellow]"
            )
    memory = next(r for r in results if r.label == "memory")
    console.print(str(memory.plan), highlight=False)

    spread = max(max(r.step_times) / min(r.step_times) for r in results)
    if spread > 1.5:
        console.print(
            f"[yellow]Step times of one policy varied up to {spread:.1f}x between runs: "
            "the machine is probably busy, so read the times with care.[/yellow]"
        )

    png = timeline_figure(results, args.out / "demo.png", title)
    console.print(
        f"\nFigure written to [bold]{png}[/bold] "
        f"(demo took {duration(time.perf_counter() - started)})."
    )
    console.print(
        "Next: profile your own model with [bold]memfit profile path/to/file.py:factory"
        "[/bold] (the factory returns (model, example_inputs)); see memfit profile "
        "--help."
    )
    return 0
