"""What a micro-batch step that accumulates into existing gradients costs per parameter.

Why: with gradient accumulation every micro-batch after the first adds into ``.grad``. memfit
adds inside its backward graph, as eager does, so a micro-batch holds one new gradient at a time
(``execution.accumulate``), and for that it checks, every micro-batch and for every parameter,
whether the engine will accumulate into it. That check is per-parameter Python, which a step of
small layers shows and a GPU step of a few milliseconds pays. This script times such steps, in
one process with interleaved rounds (medians), on an MLP of many small layers:

* ``eager``: plain PyTorch;
* ``torch.compile``: Inductor, autograd accumulating after the graph;
* ``memfit none`` (eager executor) and ``memfit-inductor none``.

Each step is a forward and a backward from ``.grad`` already set (zeros at the start), so every
step accumulates, or with ``--from-none`` from gradients set to None (the budget frontier's
protocol: the per-parameter notes for the backward are still made); each timed sample is the
mean of ``REPEAT`` steps.

Writes ``benchmarks/results/accumulate_overhead.{json,md}`` (``--out`` elsewhere).
Run: ``python benchmarks/accumulate_overhead.py [--rounds 21] [--layers 48]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import memfit  # noqa: E402
from memfit.bench import environment  # noqa: E402
from memfit.bench.environment import load_average  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

#: Steps per timed sample (one step takes a few milliseconds).
REPEAT = 40
VARIANTS = ("eager", "torch.compile", "memfit none", "memfit-inductor none")


def _model(layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    modules: list[torch.nn.Module] = []
    for _ in range(layers):
        modules += [torch.nn.Linear(16, 16), torch.nn.ReLU()]
    return torch.nn.Sequential(*modules)


def _wrap(variant: str, model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    if variant == "eager":
        return model
    if variant == "torch.compile":
        return torch.compile(model)  # type: ignore[return-value]
    if variant == "memfit none":
        return memfit.checkpoint(model, "none")
    return memfit.checkpoint(model, "none", executor="inductor")


def run(layers: int, rounds: int, from_none: bool = False) -> dict[str, Any]:
    x = torch.randn(4, 16)
    steps: dict[str, Callable[[], None]] = {}
    for variant in VARIANTS:
        model = _model(layers)
        wrapped = _wrap(variant, model)
        params = list(model.parameters())

        def step(
            wrapped: Callable[[torch.Tensor], torch.Tensor] = wrapped,
            params: list[torch.nn.Parameter] = params,
        ) -> None:
            if from_none:
                for p in params:
                    p.grad = None
            wrapped(x).sum().backward()

        step()  # capture and plan
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        step()  # the accumulating step: its graphs specialized too
        for _ in range(5):
            step()
        steps[variant] = step
    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(rounds):
        for variant, step in steps.items():
            start = time.perf_counter()
            for _ in range(REPEAT):
                step()
            samples[variant].append((time.perf_counter() - start) / REPEAT)
    compile_times = samples["torch.compile"]
    rows = []
    for variant in VARIANTS:
        times = samples[variant]
        rows.append(
            {
                "variant": variant,
                "time_s": statistics.median(times),
                "ratio_to_torch_compile": statistics.median(
                    t / c for t, c in zip(times, compile_times)
                ),
                "samples_s": times,
            }
        )
    return {
        "layers": layers,
        "parameters": sum(1 for _ in _model(layers).parameters()),
        "batch": [4, 16],
        "from_none": from_none,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument(
        "--from-none",
        action="store_true",
        help="each step from gradients set to None (the frontier's protocol), not accumulating",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    started, load_start = time.perf_counter(), load_average()
    result = run(args.layers, args.rounds, args.from_none)
    report = environment.report(
        "accumulate_overhead", ROOT, started, load_start, [result], rounds=args.rounds
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "accumulate_overhead.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"# Accumulating micro-batch steps ({report['date_utc']})",
        "",
        f"CPU ({report['machine'].get('cpu_model', report['machine']['processor'])}), torch "
        f"{torch.__version__}, {report['threads']} threads; load average {load_start} at start, "
        f"{report['load_average']['end']} at end. An MLP of {args.layers} Linear(16, 16) + ReLU "
        f"layers ({result['parameters']} parameters), batch 4x16, loss sum(out); "
        + (
            "every step from gradients set to None. "
            if args.from_none
            else "every step accumulates into existing `.grad`. "
        )
        + f"Medians of {args.rounds} interleaved rounds, each "
        f"sample the mean of {REPEAT} steps; the ratio is the median of the per-round ratios.",
        "",
        "| variant | step ms | / torch.compile |",
        "|---|---:|---:|",
    ]
    for row in result["rows"]:
        ratio = row["ratio_to_torch_compile"]
        lines.append(f"| {row['variant']} | {row['time_s'] * 1e3:.3f} | {ratio:.3f} |")
    lines.append("")
    (args.out / "accumulate_overhead.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
