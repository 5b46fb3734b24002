"""memfit points against ``torch.compile`` points, head to head in one process.

Why: the budget frontier times some 26 points round-robin, so each point's median carries the
noise of a long run on a shared machine, and on the ResNet memfit's points came out 1.00x in one
41-step run and 1.03x in the next against ``torch.compile``'s 33.7 MiB program, whose peak
memfit's ``budget=0.6`` plan reaches to the byte. This script takes just a few (by default that
pair) and measures them by the frontier's own protocol (``memfit.bench.runner``: first step,
exact peak, interleaved timing, the order rotating every round), and reports the median and the
fastest step of each and the median over rounds of its step time over the first side's in the
same round (which cancels the drift of a shared machine's speed), then profiles a few steps of
each (``torch.profiler``, CPU) to say where a difference lies: in the kernels, or in the Python
around them (AOTAutograd's runtime wrappers, memfit's own). With several memfit settings it
answers in minutes what the frontier answers in half an hour: whether the plan a setting chose
is as fast as another of the same or a lower peak.

Outputs ``benchmarks/results/same_peak_pair/<model>.{json,md}`` (``--out-dir``). Run with the
Python memfit is installed in: ``python benchmarks/same_peak_pair.py [--model resnet] [--sides
torch.compile:0.8 memfit:0.6 memfit:none ...] [--rounds 60]``; a side is ``torch.compile:`` an
``activation_memory_budget``, ``memfit:`` a budget fraction or a mode (``none``, ``speed``,
``memory``), or ``memfit-autotune:`` a budget fraction timed against ``"speed"``'s plan
(``autotune=True``). Two sides take about two minutes on 2 cores for the ResNet, each further side
about one more.
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
from budget_frontier import MODELS, RESULTS, ModelSpec, model_specs, paired_interval  # noqa: E402
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


#: memfit settings given by name rather than as a budget fraction
MODES = ("none", "speed", "memory")


def parse_side(text: str) -> tuple[str, str]:
    """``"torch.compile:0.8"``, ``"memfit:0.6"`` / ``"memfit:none"`` or
    ``"memfit-autotune:0.6"`` (a budget with ``autotune=True``) as (peer, setting)."""
    peer, _, setting = text.partition(":")
    if peer not in ("torch.compile", "memfit", "memfit-autotune") or not setting:
        raise argparse.ArgumentTypeError(
            "a side is torch.compile:<budget>, memfit:<setting> or memfit-autotune:<budget>"
        )
    if not (peer == "memfit" and setting in MODES):
        try:
            float(setting)
        except ValueError:
            modes = f" or a mode {MODES}" if peer == "memfit" else ""
            raise argparse.ArgumentTypeError(f"{text}: not a budget fraction{modes}") from None
    return peer, setting


def side(spec: ModelSpec, peer: str, setting: str) -> Method:
    """One side as a ``memfit.bench.runner`` method on its own copy of the model (``spec.build``
    is seeded), after its first step: for ``torch.compile`` under ``activation_memory_budget``,
    which must span compilation and the lazily compiled backward."""
    model = spec.build()
    entry = entry_point(model, f"pair_{peer}_{setting}")
    context: AbstractContextManager[Any] = nullcontext()
    mode = setting in MODES
    if peer == "torch.compile":
        module: Any = torch.compile(entry)
        context = activation_memory_budget(float(setting))
    elif mode:
        module = memfit.checkpoint(entry, setting, executor="inductor")
    else:
        autotune = peer == "memfit-autotune"
        module = memfit.checkpoint(
            entry, budget=float(setting), executor="inductor", autotune=autotune
        )

    def step() -> None:
        spec.loss(module(*spec.inputs)).backward()

    name = f"{peer} mode {setting}" if mode else f"{peer} budget {float(setting):g}"
    method = Method(name, model, step, record_failures=False)
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
    p.add_argument(
        "--sides",
        nargs="+",
        type=parse_side,
        default=[("torch.compile", "0.8"), ("memfit", "0.6")],
        help="peer:setting, the first the reference of the per-round ratios",
    )
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--out-dir", type=Path, default=RESULTS / "same_peak_pair")
    args = p.parse_args(argv)
    (spec,) = [s for s in model_specs(False) if s.name == args.model]
    load_start = load_average()
    methods = [side(spec, peer, setting) for peer, setting in args.sides]
    measure_peaks(methods)
    time_interleaved(methods, rounds=args.rounds)  # the start rotates each round
    reference = methods[0]
    results: dict[str, Any] = {}
    for method in methods:
        per_round = [t / r for t, r in zip(method.times, reference.times, strict=True)]
        results[method.name] = {
            "peak_bytes": method.record["peak_bytes"],
            "step_median_s": statistics.median(method.times),
            "step_min_s": min(method.times),
            "median_round_ratio": statistics.median(per_round),
            # each round one step per side: a round is what is resampled
            "round_ratio_interval": list(paired_interval(method.times, reference.times, 1)),
            "times_s": method.times,
            "profile": profiled(method)[:TOP_OPS],
        }
    record = {
        "benchmark": "same_peak_pair",
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "software": software_info(),
        "load_average": {"start": load_start, "end": load_average()},
        "model": spec.name,
        "description": spec.description,
        "rounds": args.rounds,
        "reference": reference.name,
        "sides": results,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{spec.name}.json").write_text(json.dumps(record, indent=2))
    names = [m.name for m in methods]
    title = " against ".join(reversed(names)) if len(names) == 2 else ", ".join(names)
    lines = [
        f"# {spec.name}: {title}, head to head ({record['date_utc']})",
        "",
        f"{spec.description}. {args.rounds} rounds in one process, each side one step per round "
        f"in an order rotating each round, torch {torch.__version__}, "
        f'{torch.get_num_threads()} threads, load average {load_start} at start. "per round": '
        f"the median over rounds of the side's step time over {reference.name}'s in the same "
        "round, with its 95% interval (a bootstrap over rounds).",
        "",
        "| side | peak MiB | step ms (median) | fastest step ms | median / reference's "
        "| fastest / reference's | per round | 95% interval |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ref = results[reference.name]
    for name, r in results.items():
        lo, hi = r["round_ratio_interval"]
        lines.append(
            f"| {name} | {r['peak_bytes'] / 2**20:.1f} | {r['step_median_s'] * 1e3:.2f} | "
            f"{r['step_min_s'] * 1e3:.2f} | {r['step_median_s'] / ref['step_median_s']:.3f} | "
            f"{r['step_min_s'] / ref['step_min_s']:.3f} | {r['median_round_ratio']:.3f} | "
            f"{lo:.3f}-{hi:.3f} |"
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
