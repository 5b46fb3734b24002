"""GPipe and 1F1B step time and bubble on torch.distributed, stages modelled by sleeping.

A 2-core machine cannot show a pipeline's speed-up with real compute (K processes share two
cores), so the stages here compute nothing: each stage's forward sleeps ``f_s`` and its backward
``b_s`` (``time.sleep`` holds no core), inside a custom autograd function, and a tiny tensor
carries the data dependency. What is measured is then the schedule itself as
``torch.distributed.pipelining`` runs it (``PipelineStage`` over gloo, ``ScheduleGPipe`` /
``Schedule1F1B``, one process per stage via ``memfit.pipeline.launch``): the step time against
memfit's prediction ``(M - 1) * max_s t_s + sum_s t_s`` (``t_s = f_s + b_s``;
``memfit.pipeline.pipeline_step_time``), and the bubble ``1 - M * mean_s t_s / step`` against
GPipe's ``(K - 1) / (M + K - 1)``.

Per configuration: one warm-up step, then the median of ``--repeats`` steps, each started after
a barrier and timed on every rank (a step's time is its slowest rank's). Writes
``benchmarks/results/pipeline_schedule.{json,md,png}`` (``--quick``: 10 ms stages, fewer
micro-batch counts, ``_quick`` files).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from memfit.bench.environment import load_average, machine_info, software_info
from memfit.pipeline import launch, pipeline_step_time

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.backward_s)
        return grad * 1.0, None, None


class SleepStage(nn.Module):
    """A stage whose forward takes ``forward_s`` and backward ``backward_s``, using no core."""

    def __init__(self, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.forward_s, self.backward_s = forward_s, backward_s
        self.weight = nn.Parameter(torch.ones(8))  # something for the backward to reach

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x * self.weight, self.forward_s, self.backward_s)


def _rank(
    rank: int,
    schedule: str,
    forward_s: list[float],
    backward_s: list[float],
    counts: list[int],
    repeats: int,
) -> dict[int, list[float]]:
    """Per micro-batch count: this rank's step times."""
    stages = len(forward_s)
    out: dict[int, list[float]] = {}
    for m in counts:
        module = SleepStage(forward_s[rank], backward_s[rank])
        example = torch.zeros(1, 8, requires_grad=True)
        stage = PipelineStage(
            module,
            rank,
            stages,
            torch.device("cpu"),
            input_args=(example,),
            output_args=(torch.zeros(1, 8, requires_grad=True),),
        )
        cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        sched = cls(stage, m, loss_fn=lambda out, target: out.sum())
        x, target = torch.randn(m, 8), torch.zeros(m, 8)
        times = []
        for step in range(repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0 and rank == stages - 1:
                sched.step(x, target=target)
            elif rank == 0:
                sched.step(x)
            elif rank == stages - 1:
                sched.step(target=target, losses=[])
            else:
                sched.step()
            if step:  # the first step sets up the schedule's buffers
                times.append(time.perf_counter() - start)
        out[m] = times
    return out


def run_config(
    schedule: str,
    forward_ms: list[float],
    backward_ms: list[float],
    counts: list[int],
    repeats: int,
) -> list[dict[str, Any]]:
    k = len(forward_ms)
    counts = [m for m in counts if schedule == "gpipe" or m >= k]
    per_rank = launch(
        _rank,
        k,
        args=(
            schedule,
            [f / 1e3 for f in forward_ms],
            [b / 1e3 for b in backward_ms],
            counts,
            repeats,
        ),
        timeout=900,
    )
    stage_s = [(f + b) / 1e3 for f, b in zip(forward_ms, backward_ms)]
    rows = []
    for m in counts:
        steps = [max(r[m][i] for r in per_rank) for i in range(repeats)]
        measured = statistics.median(steps)
        predicted = pipeline_step_time(stage_s, [1] * k, microbatches=m)
        busy = m * statistics.fmean(stage_s)
        rows.append(
            {
                "schedule": schedule,
                "stages": k,
                "microbatches": m,
                "forward_ms": forward_ms,
                "backward_ms": backward_ms,
                "measured_s": measured,
                "steps_s": steps,
                "predicted_s": predicted,
                "ratio": measured / predicted,
                "bubble_measured": 1 - busy / measured,
                "bubble_predicted": 1 - busy / predicted,
                "bubble_gpipe_formula": (k - 1) / (m + k - 1),
            }
        )
    return rows


def write_record(
    benchmark: str, rows: list[dict[str, Any]], started: float, out: Path, quick: bool
) -> dict[str, Any]:
    """The benchmark's JSON record (date, machine, software, load, rows, runtime since
    ``started``), written as ``{benchmark}[_quick].json`` under ``out``; also returned."""
    result = {
        "benchmark": benchmark,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "software": software_info(ROOT),
        "load_average": load_average(),
        "rows": rows,
        "seconds": round(time.perf_counter() - started, 1),
    }
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{benchmark}_quick" if quick else benchmark
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        equal = len(set(r["forward_ms"])) == 1
        key = f"K={r['stages']} {r['schedule']}{'' if equal else ' (unequal)'}"
        groups.setdefault(key, []).append(r)
    for key, rs in groups.items():
        ms = [r["microbatches"] for r in rs]
        line = ax.plot(ms, [r["measured_s"] for r in rs], "o-", label=f"{key} measured")[0]
        ax.plot(ms, [r["predicted_s"] for r in rs], "--", color=line.get_color(), alpha=0.6)
        bx.plot(ms, [r["bubble_measured"] for r in rs], "o-", color=line.get_color(), label=key)
        bx.plot(ms, [r["bubble_gpipe_formula"] for r in rs], ":", color=line.get_color())
    ax.set(
        xscale="log",
        xlabel="micro-batches M",
        ylabel="step time (s)",
        title="measured (o) vs (M-1) max t + sum t (--)",
    )
    bx.set(
        xscale="log",
        xlabel="micro-batches M",
        ylabel="bubble",
        title="measured bubble (o) vs (K-1)/(M+K-1) (:)",
    )
    ax.legend(fontsize=7)
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 ms stages, M = 1, 4, 8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    unit = 10.0 if args.quick else 20.0
    counts = [1, 4, 8] if args.quick else [1, 2, 4, 8, 16]
    started = time.perf_counter()
    configs = [
        ("gpipe", [unit] * 2, [2 * unit] * 2),
        ("1f1b", [unit] * 2, [2 * unit] * 2),
        ("gpipe", [unit] * 4, [2 * unit] * 4),
        ("1f1b", [unit] * 4, [2 * unit] * 4),
        ("gpipe", [unit / 2, unit, 1.5 * unit, unit], [unit, 2 * unit, 3 * unit, 2 * unit]),
    ]
    rows = []
    for schedule, fwd, bwd in configs:
        rows += run_config(schedule, fwd, bwd, counts, args.repeats)
    result = write_record("pipeline_schedule", rows, started, args.out, args.quick)
    stem = "pipeline_schedule_quick" if args.quick else "pipeline_schedule"
    lines = [
        "# Pipeline schedules with sleeping stages (torch.distributed.pipelining, gloo)",
        "",
        f"{result['date']}, torch {result['software']['torch']}, "
        f"{result['machine'].get('cpu_model', '?')}; median of {args.repeats} steps.",
        "",
        "| schedule | K | stage f/b ms | M | measured s | predicted s | ratio | bubble "
        "measured | bubble predicted | (K-1)/(M+K-1) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        stages = ", ".join(f"{f:g}/{b:g}" for f, b in zip(r["forward_ms"], r["backward_ms"]))
        lines.append(
            f"| {r['schedule']} | {r['stages']} | {stages} | {r['microbatches']} | "
            f"{r['measured_s']:.3f} | {r['predicted_s']:.3f} | {r['ratio']:.3f} | "
            f"{r['bubble_measured']:.1%} | {r['bubble_predicted']:.1%} | "
            f"{r['bubble_gpipe_formula']:.1%} |"
        )
    worst = max(abs(r["ratio"] - 1) for r in rows)
    lines += ["", f"Largest deviation of measured from predicted step time: {worst:.1%}."]
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    plot(rows, args.out / f"{stem}.png")
    print("\n".join(lines))  # noqa: T201
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
