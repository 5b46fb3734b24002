"""One memfit point against one ``torch.compile`` point at the same peak, head to head.

Why: the budget frontier times some 26 points round-robin, so each point's median carries the
noise of a long run on a shared machine, and on the ResNet memfit's points came out 1.00x in one
41-step run and 1.03x in the next against ``torch.compile``'s 33.7 MiB program, whose peak
memfit's ``budget=0.6`` plan reaches to the byte. This script takes just the two (by default
that pair) and measures them by the frontier's own protocol (``memfit.bench.runner``: first
step, exact peak, interleaved timing, here alternating the two every round), and reports the
median and the fastest step of each, then profiles a few steps of each (``torch.profiler``,
CPU) to say where a difference lies: in the kernels, or in the Python around them (AOTAutograd's
runtime wrappers, memfit's own).

Outputs ``benchmarks/results/same_peak_pair/<model>.{json,md}``. Run with the Python memfit is
installed in: ``python benchmarks/same_peak_pair.py [--model resnet] [--memfit-budget 0.6]
[--compile-budget 0.8] [--rounds 60]``; under a minute on 2 cores for the ResNet.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as budget_frontier.py: before torch loads

import argparse  # noqa: E402
import datetime as dt  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
from contextlib import AbstractContextManager, nullcontext  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import memfit  # noqa: E402
from budget_frontier import MODELS, RESULTS, ModelSpec, model_specs  # noqa: E402
from memfit._compat import activation_memory_budget  # noqa: E402
from memfit.bench.environment import load_average, machine_info, software_info  # noqa: E402
from memfit.bench.peers import entry_point  # noqa: E402
from memfit.bench.runner import (  # noqa: E402
    Method,
    measure_peaks,
    time_interleaved,
    warm_up,
)

#: warm-up steps per side after the first
WARM_UP = 3
#: profiled steps per side
PROFILED = 5
#: ops listed per side in the profile
TOP_OPS = 12


def side(spec: ModelSpec, peer: str, budget: float) -> Method:
    """One side as a ``memfit.bench.runner`` method on its own copy of the model (``spec.build``
    is seeded), after its first step: for ``torch.compile`` under ``activation_memory_budget``,
    which must span compilation and the lazily compiled backward."""
    model = spec.build()
    entry = entry_point(model, f"pair_{peer}_{budget}")
    context: AbstractContextManager[Any] = nullcontext()
    if peer == "torch.compile":
        module: Any = torch.compile(entry)
        context = activation_memory_budget(budget)
    else:
        module = memfit.checkpoint(entry, budget=budget, executor="inductor")

    def step() -> None:
        spec.loss(module(*spec.inputs)).backward()

    method = Method(f"{peer} budget {budget:g}", model, step, record_failures=False)
    with context:
        warm_up(method)
    for _ in range(WARM_UP):
        method.run_step()
    return method


def profiled(method: Method) -> list[dict[str, Any]]:
    """Per-step self CPU time and calls of each op over ``PROFILED`` steps, largest first."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(PROFILED):
            method.run_step()
    rows = [
        {
            "op": e.key,
            "calls_per_step": e.count / PROFILED,
            "self_ms_per_step": e.self_cpu_time_total / PROFILED / 1e3,
        }
        for e in prof.key_averages()
    ]
    return sorted(rows, key=lambda r: -r["self_ms_per_step"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet", choices=MODELS)
    p.add_argument("--memfit-budget", type=float, default=0.6)
    p.add_argument("--compile-budget", type=float, default=0.8)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--out-dir", type=Path, default=RESULTS / "same_peak_pair")
    args = p.parse_args(argv)
    (spec,) = [s for s in model_specs(False) if s.name == args.model]
    load_start = load_average()
    theirs = side(spec, "torch.compile", args.compile_budget)
    mine = side(spec, "memfit", args.memfit_budget)
    pair = [theirs, mine]
    measure_peaks(pair)
    time_interleaved(pair, rounds=args.rounds)  # alternating: the start rotates each round
    results: dict[str, Any] = {}
    for method in pair:
        results[method.name] = {
            "peak_bytes": method.record["peak_bytes"],
            "step_median_s": statistics.median(method.times),
            "step_min_s": min(method.times),
            "times_s": method.times,
            "profile": profiled(method)[:TOP_OPS],
        }
    ratio = statistics.median(mine.times) / statistics.median(theirs.times)
    min_ratio = min(mine.times) / min(theirs.times)
    record = {
        "benchmark": "same_peak_pair",
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "software": software_info(),
        "load_average": {"start": load_start, "end": load_average()},
        "model": spec.name,
        "description": spec.description,
        "rounds": args.rounds,
        "median_ratio": ratio,
        "min_ratio": min_ratio,
        "sides": results,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{spec.name}.json").write_text(json.dumps(record, indent=2))
    lines = [
        f"# {spec.name}: {mine.name} against {theirs.name}, head to head ({record['date_utc']})",
        "",
        f"{spec.description}. {args.rounds} alternating rounds in one process, torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads, load average "
        f"{load_start} at start. memfit / torch.compile: median step {ratio:.3f}, fastest step "
        f"{min_ratio:.3f}.",
        "",
        "| side | peak MiB | step ms (median) | fastest step ms |",
        "|---|---:|---:|---:|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['peak_bytes'] / 2**20:.1f} | {r['step_median_s'] * 1e3:.2f} | "
            f"{r['step_min_s'] * 1e3:.2f} |"
        )
    for name, r in results.items():
        lines += ["", f"## {name}: profile, per step", "", "| op | calls | self ms |"]
        lines.append("|---|---:|---:|")
        lines += [
            f"| {row['op'][:70]} | {row['calls_per_step']:g} | {row['self_ms_per_step']:.2f} |"
            for row in r["profile"]
        ]
    text = "\n".join(lines) + "\n"
    (args.out_dir / f"{spec.name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
