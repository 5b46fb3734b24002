"""Graph breaks in the model's own Python: memfit's chain of graph runs against plain PyTorch.

Why: issue 56. Where a model's forward breaks Dynamo's graph between its layers (a
data-dependent ``if``, an ``.item()``), memfit used to plan each small graph alone and keep every
value that crosses a break ("memory" 0.99x plain on 8 layer pairs). Now the runs form a chain
whose segments are dropped in the forward and replayed in the backward (``execution.run_chain``).
This measures, on the issue's three models, the peak of one training step and the time per step
of: plain PyTorch (twice: the A/A spread of the timing), memfit ``"none"``, memfit ``"memory"``
with the chain turned off (what memfit did before) and memfit ``"memory"``; and the first step
of ``"memory"`` against that of ``"none"`` (the issue's bound: 1.3x), and what the next steps,
which capture the graphs again once each graph is planned to keep the least, cost.

Models (CPU, float32): ``pairs``, 8 pairs of 64-wide Linears with a branch on the sign of the
mean after each, batch 8,192 (2 MiB activations); ``tanh``, 100 64-wide Linears with tanh and an
``.item()``-driven branch after each, batch 4,096 (1 MiB activations: the sqrt(n) bound is
2.5 * 10 + 3 = 28 MB); ``norm``, 8 Linears with BatchNorm, dropout and a branch, batch 2,048.
The models are those of ``tests/test_run_chain.py``.

Writes ``benchmarks/results/graph_break_chain.{json,md}`` (``--out`` elsewhere; ``--quick``:
smaller batches and fewer rounds, into ``*_quick.*``). Run with the Python memfit is installed
in: ``python benchmarks/graph_break_chain.py``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

import memfit
from memfit.bench.environment import load_average, report
from memfit.bench.runner import Method, measure_peaks, time_interleaved

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from test_run_chain import NormChain, Pairs, TanhChain  # noqa: E402  (the tests' models)

DEFAULT_OUT = ROOT / "benchmarks" / "results"


def _models(quick: bool) -> dict[str, tuple[nn.Module, torch.Tensor]]:
    torch.manual_seed(0)
    scale = 4 if quick else 1
    return {
        "pairs": (Pairs(8, 64), torch.randn(8192 // scale, 64)),
        "tanh": (TanhChain(100 if not quick else 36, 64), torch.randn(4096 // scale, 64)),
        "norm": (NormChain(8, 64), torch.randn(2048 // scale, 64)),
    }


def _step(module: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        torch.manual_seed(0)
        module(x).square().mean().backward()

    return step


def _methods(model: nn.Module, x: torch.Tensor) -> list[Method]:
    methods = []
    for name in ("plain", "plain (A/A)"):
        plain = copy.deepcopy(model)
        methods.append(Method(name, plain, _step(plain, x)))
    for name, policy, chained in (
        ("memfit none", "none", True),
        ("memfit memory, no chain", "memory", False),
        ("memfit memory", "memory", True),
    ):
        copied = copy.deepcopy(model)
        wrapped = memfit.checkpoint(copied, policy)
        if not chained:  # what memfit did before issue 56: every graph planned alone
            wrapped.memfit._planned.session.chains = lambda: False
        methods.append(Method(name, copied, _step(wrapped, x), module=wrapped))
    return methods


def _first_steps(method: Method, steps: int) -> list[float]:
    """The seconds of the first ``steps`` steps (capture, planning, the chain's tries)."""
    seconds = []
    for _ in range(steps):
        method.zero_grad()
        start = time.perf_counter()
        method.step()
        seconds.append(time.perf_counter() - start)
    return seconds


def run_model(name: str, model: nn.Module, x: torch.Tensor, rounds: int) -> dict[str, Any]:
    methods = _methods(model, x)
    record: dict[str, Any] = {"model": name, "batch": list(x.shape), "methods": {}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the graph-break warnings
        for m in methods:
            m.record["first_steps_s"] = _first_steps(m, 6)
        measure_peaks(methods)
        time_interleaved(methods, rounds, settle=1, steps=3)
    for m in methods:
        entry = {
            "peak_bytes": m.record.get("peak_bytes"),
            "first_steps_s": m.record["first_steps_s"],
            "median_step_s": statistics.median(m.times) if m.times else None,
        }
        if isinstance(m.module, memfit.CheckpointedModule):
            plan = m.module.memfit.plan
            entry["predicted_peak_bytes"] = plan.predicted_peak_bytes
            entry["graph_runs"] = len(plan.graphs)
            if plan.chain is not None:
                entry["segments"] = [list(s) for s in plan.chain.segments]
                entry["replayed_runs"] = plan.chain.replayed
                entry["replay_flops_share"] = (
                    plan.chain.replay_flops / plan.chain.forward_flops
                    if plan.chain.forward_flops
                    else 0.0
                )
        if m.failed:
            entry["failure"] = m.record.get("failure")
        record["methods"][m.name] = entry
    return record


def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "| model | method | peak (MB) | x plain | predicted (MB) | step (ms) | x plain | "
        "first step (s) | steps 2-6 (s) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        plain = r["methods"]["plain"]
        for name, m in r["methods"].items():
            if m.get("peak_bytes") is None:
                lines.append(f"| {r['model']} | {name} | failed | | | | | | |")
                continue
            pred = m.get("predicted_peak_bytes")
            step = m["median_step_s"]
            lines.append(
                f"| {r['model']} | {name} | {m['peak_bytes'] / 1e6:.2f} | "
                f"{m['peak_bytes'] / plain['peak_bytes']:.3f} | "
                f"{pred / 1e6 if pred else float('nan'):.2f} | {step * 1e3:.1f} | "
                f"{step / plain['median_step_s']:.2f} | {m['first_steps_s'][0]:.2f} | "
                f"{sum(m['first_steps_s'][1:]):.2f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller models, fewer rounds")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started, load_start = time.perf_counter(), load_average()
    rounds = args.rounds or (3 if args.quick else 10)
    results = []
    for name, (model, x) in _models(args.quick).items():
        print(f"{name} ...", flush=True)
        results.append(run_model(name, model, x, rounds))
    record = report(
        "graph_break_chain", ROOT, started, load_start, results, rounds=rounds, quick=args.quick
    )
    stem = "graph_break_chain" + ("_quick" if args.quick else "")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(record, indent=1) + "\n")
    table = markdown(results)
    (args.out / f"{stem}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
