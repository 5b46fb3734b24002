"""What Inductor's C++ wrapper (``torch._inductor.config.cpp_wrapper``) changes, for memfit's
Inductor executor and for ``torch.compile``: step time and first-step time, on CPU.

Why: Inductor's default wrapper is Python code that calls each generated kernel and each
external kernel (convolutions, matmuls) in turn, so a step of many small kernels pays Python per
kernel; the C++ wrapper makes the same calls from compiled C++, at the price of compiling that
C++ in the first step. memfit's Inductor executor honours the setting as ``torch.compile`` does
(since it passes it to Inductor as ``torch.compile`` does). This measures whether it is worth
turning on, and for which steps:

* step time: per model, the four variants (``torch.compile`` with
  ``activation_memory_budget=b`` and ``memfit.checkpoint(budget=b, executor="inductor")``, each
  with Python and with C++ wrappers) built in one process and timed in interleaved turns (each
  turn one untimed step, then ``--steps-per-turn`` timed ones; garbage collected before each
  step), medians;
* first step: each variant in a fresh Python process with a fresh Inductor cache directory
  (everything compiles, as for a user's first step), from the first call to the end of
  ``backward()``; memfit compiles every plan its measured search tries.

Models: ``mlp-40`` (40 Linear+ReLU layers of width 64, batch 32: many small kernels; as in
``first_step.py``), and the budget frontier's ResNet and U-Net (convolutions dominate).

Writes ``benchmarks/results/cpp_wrapper.{json,md}`` (``--out`` elsewhere). Run with the Python of
the environment memfit is installed in: ``python benchmarks/cpp_wrapper.py`` (about 15 minutes
on 2 cores).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
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
from memfit.bench.peers import entry_point  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

MODELS = ("mlp-40", "resnet", "unet")
#: the budget both peers run at, per model (a ReLU MLP has no plan below plain autograd's keep)
BUDGETS = {"mlp-40": 1.0, "resnet": 0.6, "unet": 0.6}
VARIANTS = (
    ("torch.compile", False),
    ("torch.compile", True),
    ("memfit", False),
    ("memfit", True),
)


def _label(peer: str, cpp: bool) -> str:
    return f"{peer}, {'C++' if cpp else 'Python'} wrapper"


def build(model_name: str) -> tuple[torch.nn.Module, tuple[Any, ...], Callable[[Any], Any]]:
    """The model, its inputs and its loss (seeded)."""
    if model_name.startswith("mlp-"):
        from first_step import _build

        return _build(model_name)
    from budget_frontier import model_specs

    (spec,) = [s for s in model_specs(False) if s.name == model_name]
    return spec.build(), spec.inputs, spec.loss


def variant_step(
    model_name: str, peer: str, cpp: bool, tag: str
) -> tuple[Callable[[], None], Callable[[], None]]:
    """One training step of ``peer`` on the model, compiled with ``cpp``'s wrapper at its first
    call (the setting is read while Inductor compiles), and a ``zero_grad`` to run before a
    measured step: the step sets gradients to None itself, which a measurement around it counts
    as freed (a 40-layer MLP's gradients are as large as its activations: its peak read 8 KiB)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    model, inputs, loss = build(model_name)
    budget = BUDGETS[model_name]
    entry = entry_point(model, tag)
    if peer == "torch.compile":
        module: Any = torch.compile(entry)
    else:
        module = memfit.checkpoint(entry, budget=budget, executor="inductor")

    def plain_step() -> None:
        for p in model.parameters():
            p.grad = None
        loss(module(*inputs)).backward()

    def first_step() -> None:  # compiles the forward and (lazily) the backward
        with (
            inductor_config.patch(cpp_wrapper=cpp),
            functorch_config.patch(activation_memory_budget=budget),
        ):
            plain_step()
        steps[0] = plain_step

    def zero_grad() -> None:
        for p in model.parameters():
            p.grad = None

    steps = [first_step]
    return (lambda: steps[0]()), zero_grad


def child(model_name: str, peer: str, cpp: bool) -> dict[str, Any]:
    """The first step of one variant in this (fresh) process."""
    torch.set_num_threads(int(os.environ.get("CPP_WRAPPER_THREADS", "2")))
    step, _ = variant_step(model_name, peer, cpp, "first")
    t = time.perf_counter()
    step()
    return {"first_step_s": time.perf_counter() - t}


def first_step(model_name: str, peer: str, cpp: bool) -> dict[str, Any]:
    from first_step import run_fresh

    return run_fresh(__file__, model_name, peer, str(int(cpp)))


def run_model(model_name: str, rounds: int, steps: int) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    stepping: list[Callable[[], None]] = []
    for i, (peer, cpp) in enumerate(VARIANTS):
        row: dict[str, Any] = {"variant": _label(peer, cpp), "peer": peer, "cpp_wrapper": cpp}
        row.update(first_step(model_name, peer, cpp))
        step, zero_grad = variant_step(model_name, peer, cpp, f"timed{i}")
        step()
        step()
        zero_grad()
        gc.collect()
        row["peak_bytes"] = memfit.measure(step, device="cpu").peak_bytes
        rows.append(row)
        stepping.append(step)
        print(f"  {model_name}: {row['variant']}: first step {row.get('first_step_s')}", flush=True)
    times: list[list[float]] = [[] for _ in VARIANTS]
    for _ in range(rounds):
        for step, samples in zip(stepping, times):
            gc.collect()
            step()
            for _ in range(steps):
                gc.collect()
                t = time.perf_counter()
                step()
                samples.append(time.perf_counter() - t)
    for row, samples in zip(rows, times):
        row["times_s"] = samples
        row["step_s"] = statistics.median(samples)
    for row in rows:
        python = next(r for r in rows if r["peer"] == row["peer"] and not r["cpp_wrapper"])
        row["step_vs_python_wrapper"] = row["step_s"] / python["step_s"]
        if "first_step_s" in row and "first_step_s" in python:
            row["first_step_vs_python_wrapper"] = row["first_step_s"] / python["first_step_s"]
    return {"name": model_name, "budget": BUDGETS[model_name], "rows": rows}


def _table(res: dict[str, Any]) -> list[str]:
    lines = [
        f"## {res['name']} (budget {res['budget']:g})",
        "",
        "| variant | peak MiB | step ms | / same peer's Python wrapper | first step s "
        "| / same peer's Python wrapper |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        first = (
            f"{r['first_step_s']:.1f} | {r['first_step_vs_python_wrapper']:.2f}"
            if "first_step_vs_python_wrapper" in r
            else "error | -"
        )
        lines.append(
            f"| {r['variant']} | {r['peak_bytes'] / 2**20:.1f} | {r['step_s'] * 1e3:.1f} "
            f"| {r['step_vs_python_wrapper']:.3f} | {first} |"
        )
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    if args_in[:1] == ["--child"]:
        _, model_name, peer, cpp = args_in
        print(json.dumps(child(model_name, peer, cpp == "1")))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps-per-turn", type=int, default=2)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(args_in)
    torch.set_num_threads(int(os.environ.get("CPP_WRAPPER_THREADS", "2")))
    started, load_start = time.perf_counter(), load_average()
    results = [run_model(name, args.rounds, args.steps_per_turn) for name in args.models]
    report = environment.report(
        "cpp_wrapper",
        ROOT,
        started,
        load_start,
        results,
        omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
        rounds=args.rounds,
        steps_per_turn=args.steps_per_turn,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cpp_wrapper.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"# Inductor's C++ wrapper ({report['date_utc']})",
        "",
        f"CPU ({report['machine'].get('cpu_model', report['machine']['processor'])}), torch "
        f"{torch.__version__}, {report['threads']} threads, OMP_WAIT_POLICY="
        f"{report['omp_wait_policy']}; step time: median of {args.rounds} interleaved turns of "
        f"1 untimed + {args.steps_per_turn} timed steps; first step: a fresh process and "
        f"Inductor cache per variant. Load average {load_start} at start, "
        f"{report['load_average']['end']} at end; {report['total_runtime_s']} s in all. "
        "torch.compile runs with activation_memory_budget = the budget, memfit with "
        'budget= it and executor="inductor".',
        "",
    ]
    for res in results:
        lines += _table(res)
    (args.out / "cpp_wrapper.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
