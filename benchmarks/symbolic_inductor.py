"""Predictions under ``executor="inductor"`` for graphs captured with symbolic sizes.

Why: with a batch or a sequence length that varies, Dynamo captures the model once more with
that size as a symbol and memfit plans one graph for a range of sizes. Under Inductor the
op-by-op simulation does not describe what runs (fused kernels hold fewer buffers), so a
prediction made from it alone can be far from the step the user runs. This measures, size by
size, the whole step (the loss computed outside the wrapped model, backward, gradients set to
``None``) against ``plan.predicted_peak_bytes`` read after the call.

Models (small, CPU, seconds per step at most), each wrapped by ``memfit.checkpoint(...,
executor="inductor")`` under ``"memory"`` and ``budget=0.5``:

* ``mlp``: 6 blocks of Linear(256, 512), GELU, Linear(512, 256), LayerNorm; rows vary;
* ``resnet``: ``zoo.cifar_resnet(1, width=8)`` (BatchNorm, convolutions); the batch varies;
* ``encoder``: ``nn.TransformerEncoder`` (3 layers, d_model 64, 4 heads); the length varies.

Per size: one call that captures or plans where needed, then one step under ``memfit.measure``
(exact CPU allocator accounting). The first size is captured with static shapes, the second
with the size as a symbol, and later sizes run on that graph or on another capture when they
fall outside its range (the JSON records each graph's planned sizes). Writes
``benchmarks/results/symbolic_inductor.{json,md}`` (``--out`` elsewhere; ``--quick``: the MLP
under ``"memory"`` at three sizes, into ``symbolic_inductor_quick.*``).
Run: ``.venv/bin/python benchmarks/symbolic_inductor.py [--quick]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

import memfit
from memfit.bench import zoo
from memfit.bench.environment import load_average, machine_info, software_info

RESULTS = Path(__file__).resolve().parent / "results"


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(6):
        blocks += [nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256), nn.LayerNorm(256)]
    return nn.Sequential(*blocks)


def _encoder() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)


def _resnet() -> nn.Module:
    return zoo.seeded(lambda: zoo.cifar_resnet(1, 8))()


Case = tuple[str, Callable[[], nn.Module], Callable[[int], torch.Tensor], tuple[int, ...]]

CASES: list[Case] = [
    ("mlp", _mlp, lambda n: torch.randn(n, 256), (1024, 1536, 2560, 2048, 3000, 1024)),
    ("resnet", _resnet, lambda n: torch.randn(n, 3, 32, 32), (8, 12, 20, 28, 24, 40)),
    ("encoder", _encoder, lambda n: torch.randn(4, n, 64), (64, 96, 160, 128, 200)),
]

#: (label, policy): the labels the results have always used
SETTINGS: list[tuple[str, str | float]] = [("policy=memory", "memory"), ("budget=0.5", 0.5)]

#: ``--quick``: the MLP under ``"memory"``: captured static, then symbolic, then a third size.
QUICK_CASES: list[Case] = [("mlp", _mlp, lambda n: torch.randn(n, 256), (256, 384, 512))]
QUICK_SETTINGS: list[tuple[str, str | float]] = SETTINGS[:1]


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def run_case(case: Case, policy: str | float) -> list[dict[str, Any]]:
    name, build, make, sizes = case
    torch.compiler.reset()
    model = build()
    wrapped = memfit.checkpoint(model, policy, executor="inductor")
    rows: list[dict[str, Any]] = []
    for size in sizes:
        x = make(size)
        row: dict[str, Any] = {"size": size}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                _loss(wrapped(x)).backward()
            except memfit.BudgetError as err:
                row["error"] = f"BudgetError: {err}"
                rows.append(row)
                model.zero_grad(set_to_none=True)
                continue
        model.zero_grad(set_to_none=True)
        step = memfit.measure(lambda x=x: _loss(wrapped(x)).backward())
        model.zero_grad(set_to_none=True)
        graph = wrapped.memfit.plan.graphs[0]
        predicted = wrapped.memfit.plan.predicted_peak_bytes
        row.update(
            measured_bytes=step.peak_bytes,
            predicted_bytes=predicted,
            measured_over_predicted=round(step.peak_bytes / predicted, 4),
            graphs=len(wrapped.memfit.plan.graphs),
            sizes=[list(s) for s in graph.sizes],
            planned_sizes=[list(s) for s in graph.planned_sizes],
            note=graph.note,
            warnings=sorted({str(w.message)[:160] for w in caught if "memfit" in str(w.filename)}),
        )
        rows.append(row)
    return rows


def markdown(result: dict[str, Any]) -> str:
    out = [
        f"# Inductor executor, symbolic sizes: measured step against prediction "
        f"({result['date_utc']})",
        "",
        f"{result['machine'].get('cpu_model', 'CPU')}, "
        f"{result['machine'].get('cpu_count')} cores, "
        f"torch {result['software'].get('torch')}; "
        f"code: {result['software'].get('git_commit', '?')[:7]}. Measured: the whole step's "
        "peak (loss outside the model, backward), exact CPU allocator accounting. A symbolic "
        "graph's row is at its planned sizes when `sizes` equals `planned`.",
        "",
        "| model | setting | size | measured MiB | predicted MiB | measured / predicted | "
        "graph's sizes | planned at |",
        "|---|---|---:|---:|---:|---:|---|---|",
    ]
    for case in result["cases"]:
        for row in case["rows"]:
            if "error" in row:
                out.append(
                    f"| {case['model']} | {case['setting']} | {row['size']} | "
                    f"{row['error'][:80]} | | | | |"
                )
                continue
            sizes = ", ".join(f"{k}={v}" for k, v in row["sizes"]) or "static"
            planned = ", ".join(f"{k}={v}" for k, v in row["planned_sizes"]) or "-"
            out.append(
                f"| {case['model']} | {case['setting']} | {row['size']} | "
                f"{row['measured_bytes'] / 2**20:.2f} | {row['predicted_bytes'] / 2**20:.2f} | "
                f"{row['measured_over_predicted']:.3f} | {sizes} | {planned} |"
            )
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the MLP under 'memory', 3 sizes")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(2)
    cases = []
    for case in QUICK_CASES if args.quick else CASES:
        for label, policy in QUICK_SETTINGS if args.quick else SETTINGS:
            print(f"{case[0]} {label}", flush=True)
            cases.append({"model": case[0], "setting": label, "rows": run_case(case, policy)})
    result = {
        "benchmark": "symbolic_inductor",
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "software": software_info(Path(__file__).resolve().parents[1]),
        "load_average": load_average(),
        "quick": args.quick,
        "cases": cases,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / ("symbolic_inductor_quick" if args.quick else "symbolic_inductor")
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
