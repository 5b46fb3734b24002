"""``python -m memfit.demo``: what memfit does, shown on one model in under a minute.

Why this exists: a new user's first question is "how much memory does this save, and what does it
cost?". The honest answer is a measurement, not a prediction, so the demo trains one step of a
small CIFAR-shaped ResNet (pre-activation ResNet v2 with BatchNorm, the kind of model gradient
checkpointing is usually sold on) under each memfit mode and reports, side by side:

* the **measured** peak tensor memory of one training step (``memfit.measure``: exact allocator
  accounting on CPU, allocator statistics on CUDA), and its ratio to ``"none"`` (keep everything);
* memfit's **predicted** peak for the same step (``wrapped.plan.predicted_peak_bytes``), so the
  planner's model can be checked against reality;
* the step time (median of 3, measured without the memory profiler, which inflates CPU time) and
  the FLOPs memfit recomputes, as a fraction of one forward.

It also writes a figure: live tensor memory over one step per mode (forward/backward boundary
marked), and peak memory per mode. Everything runs on CUDA if available, else on CPU.

The model is defined here (``cifar_resnet``) rather than imported from the tests, so the demo and
``benchmarks/depth_sweep.py`` need nothing outside the installed package. Its residual blocks form
one ``nn.Sequential`` (``model.blocks``) so that ``torch.utils.checkpoint.checkpoint_sequential``
can be applied to them for comparison.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import memfit

__all__ = ["CifarResNet", "PreActBlock", "cifar_resnet", "main", "MODES"]

#: memfit modes the demo compares, baseline first.
MODES = ("none", "speed", "memory")

_MIB = 2**20


# ----------------------------------------------------------------------------------------- model


class PreActBlock(nn.Module):
    """BN-ReLU-conv3x3, BN-ReLU-conv3x3, plus identity or 1x1-projection shortcut."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(c_in)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, stride=1, padding=1, bias=False)
        self.shortcut: nn.Module | None = None
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(x))
        skip = x if self.shortcut is None else self.shortcut(out)
        out = self.conv1(out)
        out = self.conv2(F.relu(self.bn2(out)))
        return out + skip


class CifarResNet(nn.Module):
    """Pre-activation CIFAR ResNet: ``stem`` -> ``blocks`` (one ``nn.Sequential``) -> ``head``."""

    def __init__(self, blocks_per_stage: int, width: int = 16, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1, bias=False)
        blocks: list[nn.Module] = []
        c_in = width
        for stage in range(3):
            c_out = width * 2**stage
            for b in range(blocks_per_stage):
                stride = 2 if (stage > 0 and b == 0) else 1
                blocks.append(PreActBlock(c_in, c_out, stride))
                c_in = c_out
        self.blocks = nn.Sequential(*blocks)
        self.bn = nn.BatchNorm2d(c_in)
        self.fc = nn.Linear(c_in, num_classes)

    def head(self, features: torch.Tensor) -> torch.Tensor:
        """Everything after the residual blocks: BN-ReLU, global average pool, linear."""
        out = F.relu(self.bn(features))
        return self.fc(F.adaptive_avg_pool2d(out, 1).flatten(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))


def cifar_resnet(blocks_per_stage: int, width: int = 16, num_classes: int = 10) -> CifarResNet:
    """Pre-activation CIFAR ResNet with ``3 * blocks_per_stage`` residual blocks.

    That is ``6 * blocks_per_stage + 2`` layers: ``cifar_resnet(3)`` is ResNet-20,
    ``cifar_resnet(18)`` ResNet-110. Stages have ``width``, ``2 * width`` and ``4 * width``
    channels at 32x32, 16x16 and 8x8 for a 3x32x32 input. Returned in training mode; the weights
    come from the global RNG, so seed it first for reproducibility.
    """
    return CifarResNet(blocks_per_stage, width, num_classes).train()


# ----------------------------------------------------------------------------------------- runs


@dataclass(frozen=True)
class Config:
    blocks_per_stage: int
    width: int
    batch: int
    timing_runs: int = 3


FULL = Config(blocks_per_stage=5, width=16, batch=32)  # ResNet-32, 15 residual blocks
QUICK = Config(blocks_per_stage=2, width=8, batch=8, timing_runs=2)


@dataclass
class ModeResult:
    mode: str
    peak_bytes: int
    predicted_peak_bytes: int
    step_times: list[float]
    recompute_fraction: float
    compile_s: float
    timeline: list[tuple[float, int]] = field(repr=False)
    forward_end: float  # fraction of the measured step at which the forward (and loss) ended
    measured_s: float  # duration of the memory-measured step (the timeline's time scale)
    plan_text: str = field(repr=False, default="")

    @property
    def step_time(self) -> float:
        return statistics.median(self.step_times)


def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_batch(cfg: Config, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(cfg.batch, 3, 32, 32, generator=gen)
    y = torch.randint(0, 10, (cfg.batch,), generator=gen)
    return x.to(device), y.to(device)


def make_step(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, marks: list[float] | None = None
) -> Callable[[], float]:
    """One training step (forward, loss, backward); returns the loss.

    If ``marks`` is given, ``[start, end of forward]`` (``time.perf_counter``) are appended.
    """

    def step() -> float:
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        if marks is not None:
            if x.is_cuda:
                torch.cuda.synchronize(x.device)
            marks.extend([t0, time.perf_counter()])
        loss.backward()
        return loss.item()

    return step


@dataclass
class Run:
    """One mode's wrapped model while the demo measures it."""

    mode: str
    model: nn.Module
    wrapped: memfit.CheckpointedModule
    compile_s: float = 0.0
    times: list[float] = field(default_factory=list)


def prepare(mode: str, cfg: Config, device: torch.device,
            batch: tuple[torch.Tensor, torch.Tensor]) -> Run:
    """Wrap a freshly seeded model in ``mode`` and run one step: capture, plan, compile."""
    torch.manual_seed(0)
    model = cifar_resnet(cfg.blocks_per_stage, cfg.width).to(device)
    run = Run(mode, model, memfit.checkpoint(model, mode))
    t0 = time.perf_counter()
    make_step(run.wrapped, *batch)()
    run.compile_s = time.perf_counter() - t0
    return run


def measure_memory(run: Run, device: torch.device,
                   batch: tuple[torch.Tensor, torch.Tensor]) -> ModeResult:
    """One step under ``memfit.measure``: peak, timeline, and where the forward ended."""
    run.model.zero_grad(set_to_none=True)
    marks: list[float] = []
    m = memfit.measure(make_step(run.wrapped, *batch, marks), device=device)
    forward_end = (marks[1] - marks[0]) / m.time_s if m.time_s > 0 else 0.5
    plan = run.wrapped.plan
    return ModeResult(
        mode=run.mode,
        peak_bytes=int(m.peak_bytes or 0),
        predicted_peak_bytes=plan.predicted_peak_bytes,
        step_times=run.times,  # filled in by time_step
        recompute_fraction=plan.recompute_flops / plan.forward_flops if plan.forward_flops else 0.0,
        compile_s=run.compile_s,
        timeline=list(m.timeline),
        forward_end=min(max(forward_end, 0.0), 1.0),
        measured_s=m.time_s,
        plan_text=str(plan),
    )


def time_step(run: Run, device: torch.device, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    """One step timed without the memory profiler (which inflates CPU time)."""
    run.model.zero_grad(set_to_none=True)
    step = make_step(run.wrapped, *batch)
    run.times.append(memfit.measure(step, device=device, profile_memory=False).time_s)


def run_all(cfg: Config, device: torch.device, modes: Sequence[str], console) -> list[ModeResult]:
    """Compile every mode, measure each one's memory, then time them round-robin.

    Dynamo is reset once, before the wraps: each wrap has its own backend, so the wraps coexist in
    Dynamo's cache (well under its recompile limit) and none is recompiled while being measured.
    Interleaving the timed steps spreads a busy machine's slow moments over all modes.
    """
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    torch._dynamo.reset()
    batch = make_batch(cfg, device)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                  TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task("starting", total=len(modes) * (2 + cfg.timing_runs))

        def doing(text: str) -> None:
            progress.update(task, description=text)

        runs = []
        for mode in modes:
            doing(f"{mode}: capturing, planning, compiling (first step)")
            runs.append(prepare(mode, cfg, device, batch))
            progress.advance(task)
        plans = [run.wrapped.plan for run in runs]
        results = []
        for run in runs:
            doing(f"{run.mode}: measuring memory of one step")
            results.append(measure_memory(run, device, batch))
            progress.advance(task)
        for i in range(cfg.timing_runs):
            for run in runs:
                doing(f"{run.mode}: timing step {i + 1} of {cfg.timing_runs}")
                time_step(run, device, batch)
                progress.advance(task)
        doing("done")
    for run, plan in zip(runs, plans):
        if run.wrapped.plan is not plan:
            console.print(f"[yellow]warning: {run.mode} was captured again while being "
                          "measured; its numbers include a recompilation[/yellow]")
    return results


# ----------------------------------------------------------------------------------------- report


def _mib(n: float) -> str:
    return f"{n / _MIB:.1f} MiB"


def _ms(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s < 10 else f"{s:.1f} s"


def results_table(results: Sequence[ModeResult], title: str):
    from rich.table import Table

    base = next((r for r in results if r.mode == "none"), results[0])
    table = Table(title=title)
    for name, justify in [("mode", "left"), ("measured peak", "right"), ("vs none", "right"),
                          ("predicted peak", "right"), ("step time", "right"),
                          ("vs none", "right"), ("recomputed", "right"),
                          ("first step", "right")]:
        table.add_column(name, justify=justify)
    for r in results:
        table.add_row(
            r.mode,
            _mib(r.peak_bytes),
            f"{r.peak_bytes / base.peak_bytes:.2f}x" if base.peak_bytes else "-",
            _mib(r.predicted_peak_bytes),
            _ms(r.step_time),
            f"{r.step_time / base.step_time:.2f}x" if base.step_time else "-",
            f"{r.recompute_fraction:.0%} of fwd",
            f"{r.compile_s:.1f} s",
        )
    return table


def write_figure(results: Sequence[ModeResult], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"none": "tab:gray", "speed": "tab:blue", "memory": "tab:green"}
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(12, 4.5), width_ratios=[2, 1])
    for r in results:
        c = colors.get(r.mode, None)
        end = max(r.measured_s, 1e-12)
        ts = [t / end for t, _ in r.timeline]
        bs = [b / _MIB for _, b in r.timeline]
        ax_t.step(ts, bs, where="post", color=c, label=f"{r.mode} (peak {_mib(r.peak_bytes)})")
        ax_t.axvline(r.forward_end, color=c, linestyle="--", linewidth=1)
    ax_t.set_xlim(0, 1)
    ax_t.set_ylim(bottom=0)
    ax_t.set_xlabel("fraction of the training step (dashed: forward ends, backward starts)")
    ax_t.set_ylabel("live tensor memory above step start (MiB)")
    sparse = all(len(r.timeline) <= 2 for r in results)  # CUDA: measure records the end points
    ax_t.set_title("(a) memory over one training step"
                   + (" (only start and end recorded on this device)" if sparse else ""))
    ax_t.legend(loc="lower right", framealpha=0.9)

    names = [r.mode for r in results]
    xs = range(len(results))
    ax_b.bar(xs, [r.peak_bytes / _MIB for r in results],
             color=[colors.get(n, "tab:orange") for n in names], label="measured")
    ax_b.scatter(xs, [r.predicted_peak_bytes / _MIB for r in results], color="black", marker="_",
                 s=600, zorder=3, label="predicted by memfit")
    ax_b.set_xticks(list(xs), names)
    ax_b.set_ylabel("peak tensor memory (MiB)")
    ax_b.set_title("(b) peak memory per mode")
    ax_b.legend(loc="upper right", framealpha=0.9)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m memfit.demo",
        description="Measure memfit's checkpointing modes on a small CIFAR ResNet.",
    )
    parser.add_argument("--out", type=Path, default=Path("memfit-demo"),
                        help="directory for demo.png (default: ./memfit-demo)")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny model and fewer timing runs (for tests)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    from rich.console import Console

    args = parse_args(argv)
    cfg = QUICK if args.quick else FULL
    device = pick_device()
    # A pipe or a test's capture reports 80 columns, too narrow for the table.
    console = Console(width=None if sys.stdout.isatty() else 110)
    n_blocks = 3 * cfg.blocks_per_stage
    title = (f"ResNet-{6 * cfg.blocks_per_stage + 2} ({n_blocks} residual blocks, width "
             f"{cfg.width}), batch {cfg.batch}x3x32x32, one training step on {device.type}")
    console.print(f"[bold]memfit demo[/bold]: {title}")
    console.print("Each mode: one first step (capture, plan, compile), one step measured for "
                  f"memory, then {cfg.timing_runs} timed steps, taken in turn across the modes.")

    started = time.perf_counter()
    results = run_all(cfg, device, MODES, console)
    console.print(results_table(results, title="one training step (forward + loss + backward)"))
    memory = next(r for r in results if r.mode == "memory")
    console.print(memory.plan_text, highlight=False)

    spread = max(max(r.step_times) / min(r.step_times) for r in results)
    if spread > 1.5:
        console.print(f"[yellow]Step times of one mode varied up to {spread:.1f}x between runs: "
                      "the machine is probably busy, so read the times with care (on a shared "
                      "CPU, OMP_WAIT_POLICY=PASSIVE helps).[/yellow]")

    png = write_figure(results, args.out / "demo.png", title)
    console.print(f"\nFigure written to [bold]{png}[/bold] "
                  f"(demo took {time.perf_counter() - started:.0f} s).")
    console.print("Next: wrap your own model with [bold]memfit.checkpoint(model, \"memory\")"
                  "[/bold], train as usual, and print [bold]wrapped.plan[/bold] after the first "
                  "step; check the saving with [bold]memfit.measure(step)[/bold].")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
