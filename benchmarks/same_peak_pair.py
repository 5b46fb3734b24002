"""One memfit point against one ``torch.compile`` point at the same peak, head to head.

Why: the budget frontier times some 26 points round-robin, so each point's median carries the
noise of a long run on a shared machine, and on the ResNet memfit's points came out 1.00x in one
41-step run and 1.03x in the next against ``torch.compile``'s 33.7 MiB program, whose peak
memfit's ``budget=0.6`` plan reaches to the byte. This script takes just the two (by default
that pair), alternates their steps in one process (the order flipped every round, automatic
garbage collection off during the rounds), and reports the forward and backward medians and the
fastest step of each, then profiles a few steps of each (``torch.profiler``, CPU) to say where a
difference lies: in the kernels, or in the Python around them (AOTAutograd's runtime wrappers,
memfit's own).

Outputs ``benchmarks/results/same_peak_pair/<model>.{json,md}``. Run with the Python memfit is
installed in: ``python benchmarks/same_peak_pair.py [--model resnet] [--memfit-budget 0.6]
[--compile-budget 0.8] [--rounds 60]``; about 3 minutes on 2 cores for the ResNet.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as budget_frontier.py: before torch loads

import argparse  # noqa: E402
import datetime as dt  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import memfit  # noqa: E402
from budget_frontier import RESULTS, ModelSpec, model_specs  # noqa: E402
from memfit._compat import activation_memory_budget  # noqa: E402
from memfit.bench.environment import load_average, machine_info, software_info  # noqa: E402
from memfit.bench.peers import entry_point  # noqa: E402

#: profiled steps per side
PROFILED = 5
#: ops listed per side in the profile
TOP_OPS = 12


def train_step(spec: ModelSpec, module: Callable[..., Any], model: nn.Module) -> float:
    """One step from gradients set to None; returns the forward's seconds (loss included)."""
    for p in model.parameters():
        p.grad = None
    start = time.perf_counter()
    loss = spec.loss(module(*spec.inputs))
    forward = time.perf_counter() - start
    loss.backward()
    return forward


def build(spec: ModelSpec, side: str, budget: float) -> tuple[Callable[..., Any], nn.Module]:
    """The side's module on its own copy of the model (same seed), after its first step."""
    torch.manual_seed(0)
    model = spec.build()
    if side == "torch.compile":
        with activation_memory_budget(budget):  # spans compilation and the lazy backward
            module: Callable[..., Any] = torch.compile(entry_point(model, f"pair_compile_{budget}"))
            train_step(spec, module, model)
    else:
        module = memfit.checkpoint(
            entry_point(model, f"pair_memfit_{budget}"), budget=budget, executor="inductor"
        )
        train_step(spec, module, model)
    return module, model


def timed(
    spec: ModelSpec, sides: dict[str, tuple[Callable[..., Any], nn.Module]], rounds: int
) -> dict[str, dict[str, list[float]]]:
    out: dict[str, dict[str, list[float]]] = {k: {"step": [], "forward": []} for k in sides}
    names = list(sides)
    for _ in range(3):  # warm-up
        for name in names:
            train_step(spec, *sides[name])
    gc.collect()
    gc.disable()
    try:
        for r in range(rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                start = time.perf_counter()
                forward = train_step(spec, *sides[name])
                out[name]["step"].append(time.perf_counter() - start)
                out[name]["forward"].append(forward)
    finally:
        gc.enable()
    return out


def profiled(spec: ModelSpec, module: Callable[..., Any], model: nn.Module) -> list[dict[str, Any]]:
    """Per-step self CPU time and calls of each op over ``PROFILED`` steps, largest first."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(PROFILED):
            train_step(spec, module, model)
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
    p.add_argument("--model", default="resnet", choices=("resnet", "transformer", "unet"))
    p.add_argument("--memfit-budget", type=float, default=0.6)
    p.add_argument("--compile-budget", type=float, default=0.8)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--out-dir", type=Path, default=RESULTS / "same_peak_pair")
    args = p.parse_args(argv)
    (spec,) = [s for s in model_specs(False) if s.name == args.model]
    load_start = load_average()
    sides = {
        f"torch.compile budget {args.compile_budget:g}": build(
            spec, "torch.compile", args.compile_budget
        ),
        f"memfit budget {args.memfit_budget:g}": build(spec, "memfit", args.memfit_budget),
    }
    peaks = {
        name: memfit.measure(lambda s=side: train_step(spec, *s)).peak_bytes
        for name, side in sides.items()
    }
    times = timed(spec, sides, args.rounds)
    results: dict[str, Any] = {}
    for name, side in sides.items():
        steps, fwd = times[name]["step"], times[name]["forward"]
        results[name] = {
            "peak_bytes": peaks[name],
            "step_median_s": statistics.median(steps),
            "forward_median_s": statistics.median(fwd),
            "backward_median_s": statistics.median(s - f for s, f in zip(steps, fwd)),
            "step_min_s": min(steps),
            "times_s": steps,
            "profile": profiled(spec, *side)[:TOP_OPS],
        }
    (mine,) = [k for k in results if k.startswith("memfit")]
    (theirs,) = [k for k in results if k.startswith("torch.compile")]
    ratio = results[mine]["step_median_s"] / results[theirs]["step_median_s"]
    min_ratio = results[mine]["step_min_s"] / results[theirs]["step_min_s"]
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
        f"# {spec.name}: {mine} against {theirs}, head to head ({record['date_utc']})",
        "",
        f"{spec.description}. {args.rounds} alternating rounds in one process, torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads, load average "
        f"{load_start} at start. memfit / torch.compile: median step {ratio:.3f}, fastest step "
        f"{min_ratio:.3f}.",
        "",
        "| side | peak MiB | step ms (median) | forward | backward | fastest step |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['peak_bytes'] / 2**20:.1f} | {r['step_median_s'] * 1e3:.2f} | "
            f"{r['forward_median_s'] * 1e3:.2f} | {r['backward_median_s'] * 1e3:.2f} | "
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
