"""Predicted vs measured peak of budget plans on every zoo model (issue 4, item 3).

For budgets 1.0, 0.5, 0.25 (fractions of the activations plain autograd keeps), the smallest
feasible one and the midpoint between it and plain autograd:
the plan's ``predicted_peak_bytes`` (made before the step runs) against the peak ``memfit.measure``
records for a training step (exact CPU allocator accounting, or CUDA allocator statistics), and
the planning time. Budgets below the smallest feasible are recorded with the BudgetError's
smallest achievable bytes. Writes ``benchmarks/results/budget_accuracy.{json,md}`` (``--out``
elsewhere; ``--quick``: the zoo's MLP, ResNet and transformer only, into
``budget_accuracy_quick.*``).

Run with the Python of the environment memfit is installed in (``pip install -e .``; the
Makefile's ``.venv``): ``python benchmarks/budget_accuracy.py [--quick]``. The models come from
the package's zoo, ``memfit.bench.zoo``, and each step's peak from its ``measured_step_peak``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import memfit
from memfit.bench.zoo import (
    ZOO,
    Inputs,
    ZooCase,
    cifar_resnet,
    measured_step_peak,
    randn,
    seeded,
    tanh_chain_case,
    unet,
)
from memfit.units import MIB

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
#: The zoo models ``--quick`` plans and measures.
QUICK = ("mlp", "resnet", "transformer")


def _larger() -> list[ZooCase]:
    """Bigger versions of zoo shapes, where activations dominate and 0.5 / 0.25 can be met."""

    def inputs(*shape: int) -> Callable[[], Inputs]:
        return lambda: ((randn(*shape),), {})

    return [
        tanh_chain_case(100),
        ZooCase(
            "resnet56-b32",
            seeded(lambda: cifar_resnet(9)),
            inputs(32, 3, 32, 32),
            lambda out: out.square().mean(),
        ),
        ZooCase(
            "unet-4conv-b8",
            seeded(lambda: unet(depth=3, width=8, convs_per_block=4)),
            inputs(8, 1, 128, 128),
            lambda out: out.square().mean(),
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--quick", action="store_true", help="three small zoo models only")
    args_ns = parser.parse_args(argv)
    rows = []
    cases = [c for c in ZOO if c.name in QUICK] if args_ns.quick else [*ZOO, *_larger()]
    for case in cases:
        args, kwargs = case.make_inputs()
        model = case.make_model()
        torch.compiler.reset()
        t = time.perf_counter()
        full = memfit.plan(model, *args, policy=1.0, **kwargs)
        plan_s = time.perf_counter() - t
        smallest, baseline = full.pareto()[0].peak_bytes, full.baseline_peak_bytes
        midpoint = (smallest + baseline) // 2
        budgets: list[float | int] = [1.0, 0.5, 0.25, midpoint, smallest]
        if midpoint <= smallest:  # nothing to trade: plain autograd is already the smallest
            budgets.remove(midpoint)
        for budget in budgets:
            torch.compiler.reset()
            wrapped = memfit.checkpoint(model, budget)
            label = (
                f"{budget:g}"
                if isinstance(budget, float)
                else "smallest"
                if budget == smallest
                else "midpoint"
            )
            row: dict[str, Any] = {"model": case.name, "budget": label}
            try:
                peak = measured_step_peak(case, wrapped, args, kwargs)
            except memfit.BudgetError as err:
                row.update(
                    feasible=False, budget_bytes=err.budget_bytes, smallest_bytes=err.least_bytes
                )
                rows.append(row)
                continue
            plan = wrapped.memfit.plan
            predicted = plan.predicted_peak_bytes
            row.update(
                feasible=True,
                budget_bytes=plan.budget_bytes,
                predicted_bytes=predicted,
                measured_bytes=peak,
                baseline_bytes=plan.baseline_peak_bytes,
                error=(peak - predicted) / predicted if predicted else 0.0,
                over_budget=(peak - plan.budget_bytes) / plan.budget_bytes,
                recompute_flops=plan.recompute_flops,
                forward_flops=plan.forward_flops,
                graphs=len(plan.graphs),
                plan_s=plan_s,
            )
            rows.append(row)
            print(
                f"{case.name:>12} {label:>8}: predicted {predicted / MIB:7.3f} MiB, "
                f"measured {peak / MIB:7.3f} MiB ({row['error']:+.2%})",
                flush=True,
            )
    meta = {
        "machine": f"{platform.node()} ({platform.processor() or platform.machine()})",
        "device": "cpu",
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "quick": args_ns.quick,
    }
    args_ns.out.mkdir(parents=True, exist_ok=True)
    stem = args_ns.out / ("budget_accuracy_quick" if args_ns.quick else "budget_accuracy")
    stem.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=2))
    lines = [
        f"Budget plans, predicted vs measured peak ({meta['machine']}, torch "
        f"{meta['torch']}, {meta['date']})",
        "",
        "| model | budget | budget (MiB) | predicted (MiB) | measured (MiB) | error | "
        "measured / none |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if not r["feasible"]:
            lines.append(
                f"| {r['model']} | {r['budget']} | {r['budget_bytes'] / MIB:.2f} | "
                f"infeasible: smallest {r['smallest_bytes'] / MIB:.2f} | | | |"
            )
            continue
        lines.append(
            f"| {r['model']} | {r['budget']} | {r['budget_bytes'] / MIB:.2f} | "
            f"{r['predicted_bytes'] / MIB:.2f} | {r['measured_bytes'] / MIB:.2f} | "
            f"{r['error']:+.1%} | {r['measured_bytes'] / r['baseline_bytes']:.2f} |"
        )
    errors = [abs(r["error"]) for r in rows if r["feasible"]]
    lines += ["", f"Largest |error|: {max(errors):.1%} over {len(errors)} plans."]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
