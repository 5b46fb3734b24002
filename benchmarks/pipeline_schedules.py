"""Step time and bubble of the schedules with several stages per rank, stages modelled by sleeping.

``pipeline_schedule.py`` checks GPipe's and 1F1B's step against ``(M - 1) max t + sum t``; this
script does the same for the five schedules ``torch.distributed.pipelining`` runs with several
stages per rank (interleaved 1F1B, looped BFS, interleaved zero bubble, ZBV, DualPipeV), against
memfit's prediction, the step simulated on the order torch runs them in
(``memfit.pipeline.timeline.simulate_step``). Each stage sleeps its forward ``f`` and backward
``b`` (``pipeline_schedule.SleepStage``: no core held, so K ranks fit on two cores), two stages
per rank placed as memfit places them (``memfit.pipeline.placement``), the zero-bubble ones with
the backward in one piece at the input step as memfit runs them (an empty weight step). Beside
the measured and predicted bubble: GPipe's ``(K - 1) / (M + K - 1)`` over whole ranks and
Megatron's interleaved ``(K - 1) / (V M + K - 1)``.

Per configuration: one warm-up step, then the median of ``--repeats`` steps, each started after
a barrier and timed on every rank (a step's time is its slowest rank's). Writes
``benchmarks/results/pipeline_schedules.{json,md}`` (``--quick``: 10 ms stages, M = 8 only,
``_quick`` files).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

from memfit.pipeline import launch
from memfit.pipeline.placement import local_stages
from memfit.pipeline.schedule import check_schedule, splits_backward
from memfit.pipeline.timeline import simulate_step
from pipeline_schedule import SleepStage, write_record

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
#: memfit's name of each schedule, and the torch class that runs it
SCHEDULES = {
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "looped_bfs": ScheduleLoopedBFS,
    "interleaved_zero_bubble": ScheduleInterleavedZeroBubble,
    "zbv_zero_bubble": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}
PER_RANK = 2


def _rank(
    rank: int,
    ranks: int,
    forward_s: float,
    backward_s: float,
    jobs: list[tuple[str, int]],
    repeats: int,
) -> dict[str, list[float]]:
    """Per (schedule, M): this rank's step times."""
    total = ranks * PER_RANK
    out: dict[str, list[float]] = {}
    for schedule, m in jobs:
        mine = local_stages(schedule, ranks, PER_RANK, rank)
        stages = [
            PipelineStage(
                SleepStage(forward_s, backward_s),
                s,
                total,
                torch.device("cpu"),
                input_args=(torch.zeros(1, 8, requires_grad=True),),
                output_args=(torch.zeros(1, 8, requires_grad=True),),
                dw_builder=(lambda: lambda: None) if splits_backward(schedule) else None,
            )
            for s in mine
        ]
        sched = SCHEDULES[schedule](stages, m, loss_fn=lambda out, target: out.sum())
        x, target = torch.randn(m, 8), torch.zeros(m, 8)
        first, last = 0 in mine, total - 1 in mine
        times = []
        for step in range(repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            if first and last:
                sched.step(x, target=target, losses=[])
            elif first:
                sched.step(x)
            elif last:
                sched.step(target=target, losses=[])
            else:
                sched.step()
            if step:  # the first step sets up the schedule's buffers
                times.append(time.perf_counter() - start)
        out[f"{schedule} {m}"] = times
    return out


def run_ranks(
    ranks: int, forward_ms: float, backward_ms: float, counts: list[int], repeats: int
) -> list[dict[str, Any]]:
    jobs = []
    for schedule in SCHEDULES:
        for m in counts:
            try:
                check_schedule(schedule, ranks, m, PER_RANK)
            except ValueError:
                continue
            jobs.append((schedule, m))
    per_rank = launch(
        _rank,
        ranks,
        args=(ranks, forward_ms / 1e3, backward_ms / 1e3, jobs, repeats),
        timeout=1800,
    )
    total = ranks * PER_RANK
    rows = []
    for schedule, m in jobs:
        key = f"{schedule} {m}"
        steps = [max(r[key][i] for r in per_rank) for i in range(repeats)]
        measured = statistics.median(steps)
        forward, backward = [forward_ms / 1e3] * total, [backward_ms / 1e3] * total
        predicted, bubble = simulate_step(schedule, ranks, PER_RANK, m, forward, backward)
        busy = m * total * (forward_ms + backward_ms) / 1e3
        rows.append(
            {
                "schedule": schedule,
                "ranks": ranks,
                "stages_per_rank": PER_RANK,
                "microbatches": m,
                "forward_ms": forward_ms,
                "backward_ms": backward_ms,
                "measured_s": measured,
                "steps_s": steps,
                "predicted_s": predicted,
                "ratio": measured / predicted,
                "bubble_measured": 1 - busy / (ranks * measured),
                "bubble_predicted": bubble,
                "bubble_gpipe_formula": (ranks - 1) / (m + ranks - 1),
                "bubble_interleaved_formula": (ranks - 1) / (PER_RANK * m + ranks - 1),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 ms stages, M = 8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    unit = 10.0 if args.quick else 20.0
    counts = [8] if args.quick else [4, 8, 16]
    started = time.perf_counter()
    rows = []
    for ranks in (2, 4):
        rows += run_ranks(ranks, unit, 2 * unit, counts, args.repeats)
    result = write_record("pipeline_schedules", rows, started, args.out, args.quick)
    stem = "pipeline_schedules_quick" if args.quick else "pipeline_schedules"
    lines = [
        "# Schedules with two stages per rank, sleeping stages (torch.distributed.pipelining)",
        "",
        f"{result['date']}, torch {result['software']['torch']}, "
        f"{result['machine'].get('cpu_model', '?')}; stages of {unit:g} ms forward and "
        f"{2 * unit:g} ms backward; median of {args.repeats} steps.",
        "",
        "| schedule | K | M | measured s | predicted s | ratio | bubble measured | "
        "bubble predicted | (K-1)/(M+K-1) | (K-1)/(VM+K-1) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['schedule']} | {r['ranks']} | {r['microbatches']} | {r['measured_s']:.3f} | "
            f"{r['predicted_s']:.3f} | {r['ratio']:.3f} | {r['bubble_measured']:.1%} | "
            f"{r['bubble_predicted']:.1%} | {r['bubble_gpipe_formula']:.1%} | "
            f"{r['bubble_interleaved_formula']:.1%} |"
        )
    worst = max(abs(r["ratio"] - 1) for r in rows)
    lines += ["", f"Largest deviation of measured from predicted step time: {worst:.1%}."]
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))  # noqa: T201
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
