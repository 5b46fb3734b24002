"""Offload: what swapping activations out buys against recomputation alone, measured.

Why: offload is worth having only if, at the memory it reaches, the step is no slower than the
recompute-only plan reaching the same memory, and if it reaches memory recomputation cannot. This
script measures both on CPU with disk offload (the only destination this machine has; on CUDA the
same script runs with host offload when given ``--device cuda``):

1. **Frontier** per model (the zoo's ResNet and U-Net, sized up): plain eager, memfit ``"none"``,
   ``"memory"``, ``"swap"``, ``"memory"`` with offload, and ``budget=f`` for fractions ``f`` of
   ``"none"``'s predicted peak, each with and without ``offload=True`` (a budget below what a plan
   reaches raises ``BudgetError``: recorded as infeasible). Per point: measured peak (exact CPU
   allocator accounting), predicted peak, offloaded bytes, predicted stall, step time (median of
   ``--rounds`` interleaved steps). Then: the lowest measured peak with and without offload, and
   for every offload point the recompute-only point within 5% of its peak (time ratio).
2. **Largest batch** under a fixed budget (``--max-batch-budget``, weights + batch + measured
   peak) on a ResNet-50-like network (bottleneck blocks 3-4-6-3, base width 16, 32x32 images),
   searched with real steps as ``memfit profile --budget --offload`` does, for plain ``"none"``,
   ``"memory"``, ``"swap"`` and ``"memory"`` with offload.

Disk offload on CPU moves bytes from the process's tensors to files; the OS page cache may keep
them in RAM, which the allocator accounting rightly does not count as tensor memory (it is
reclaimable), but a machine without spare RAM would read them from the disk.

Writes ``benchmarks/results/offload.json`` and ``.md`` naming machine, torch and date (``--out``
elsewhere; ``--quick``: one small ResNet, budgets 0.8 and 0.6, 3 rounds, no largest-batch search,
into ``offload_quick.*``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

import memfit
from memfit.bench.environment import load_average, machine_info, software_info
from memfit.bench.peers import entry_point
from memfit.bench.runner import Method, measure_peaks, time_interleaved, warm_up
from memfit.bench.zoo import cifar_resnet, unet
from memfit.cli.batch_search import measure_probe, search_max_batch
from memfit.cli.steps import Workload
from memfit.execution.offload import measure_link
from memfit.planning.budget import Budget
from memfit.planning.policy import BUDGET, Policy

ROOT = Path(__file__).resolve().parent.parent
FRACTIONS = (0.8, 0.6, 0.5, 0.45, 0.4, 0.35, 0.3, 0.25)
QUICK_FRACTIONS = (0.8, 0.6)
PEAK_TOLERANCE = 0.05


def _xent0(logits: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, torch.zeros(len(logits), dtype=torch.long))


def _square(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def frontier_models(quick: bool) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    if quick:
        return [
            {
                "name": "resnet",
                "make": lambda: cifar_resnet(2, width=8),
                "x": torch.randn(16, 3, 32, 32, generator=g),
                "loss": _xent0,
            }
        ]
    return [
        {
            "name": "resnet",
            "make": lambda: cifar_resnet(3, width=16),
            "x": torch.randn(64, 3, 32, 32, generator=g),
            "loss": _xent0,
        },
        {
            "name": "unet",
            "make": lambda: unet(depth=3, width=16),
            "x": torch.randn(8, 1, 64, 64, generator=g),
            "loss": _square,
        },
    ]


class Bottleneck(nn.Module):
    """ResNet-50's block: 1x1 reduce, 3x3, 1x1 expand (x4), BatchNorm and ReLU, projection skip."""

    def __init__(self, c_in: int, width: int, stride: int) -> None:
        super().__init__()
        out = width * 4
        self.body = nn.Sequential(
            nn.Conv2d(c_in, width, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, width, 3, stride, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, out, 1, bias=False),
            nn.BatchNorm2d(out),
        )
        self.skip = (
            nn.Sequential(nn.Conv2d(c_in, out, 1, stride, bias=False), nn.BatchNorm2d(out))
            if stride != 1 or c_in != out
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


def resnet50_like(base: int = 16, classes: int = 10) -> nn.Module:
    """ResNet-50's layout (3-4-6-3 bottlenecks) at ``base`` channels, for 32x32 images."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, base, 3, 1, 1, bias=False),
        nn.BatchNorm2d(base),
        nn.ReLU(),
    ]
    c = base
    for stage, blocks in enumerate((3, 4, 6, 3)):
        width = base * 2**stage
        for i in range(blocks):
            layers.append(Bottleneck(c, width, 2 if i == 0 and stage > 0 else 1))
            c = width * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, classes)]
    return nn.Sequential(*layers)


def policies(fractions: tuple[float, ...]) -> list[tuple[str, Policy | None]]:
    out: list[tuple[str, Policy | None]] = [("eager", None)]
    out += [(name, Policy(name)) for name in ("none", "memory", "swap")]
    out.append(("memory + offload", Policy("memory", offload=True)))
    for f in fractions:
        budget = Budget(fraction=f)
        out.append((f"budget {f:g}", Policy(BUDGET, budget=budget)))
        out.append((f"budget {f:g} + offload", Policy(BUDGET, budget=budget, offload=True)))
    return out


def run_frontier(spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    torch.compiler.reset()
    x, loss = spec["x"].to(args.device), spec["loss"]
    methods: list[Method] = []
    for label, policy in policies(QUICK_FRACTIONS if args.quick else FRACTIONS):
        torch.manual_seed(0)
        model = spec["make"]().to(args.device)
        record: dict[str, Any] = {"label": label, "policy": policy.label if policy else "eager"}
        if policy is None:
            module: nn.Module = model
        else:
            module = memfit.checkpoint(entry_point(model, f"{spec['name']}_{label}"), policy)

        def step(module: nn.Module = module) -> None:
            loss(module(x)).backward()

        method = Method(label, model, step, module, record)
        print(f"  {spec['name']}: {label}: first step", flush=True)
        if warm_up(method, args.device) and policy is not None:
            plan = module.memfit.plan  # type: ignore[union-attr]
            record.update(
                predicted_peak_bytes=plan.predicted_peak_bytes,
                offloaded_bytes=plan.offloaded_bytes,
                offloaded_tensors=len(plan.offloaded),
                offload_to=plan.offload_to,
                predicted_stall_s=plan.stall_seconds,
                transfer_s=plan.transfer_seconds,
                recompute_flops=int(plan.recompute_flops),
                kept_bytes=plan.kept_bytes,
            )
        methods.append(method)
    measure_peaks(methods, args.device)
    time_interleaved(methods, args.rounds, args.device)
    points = []
    for m in methods:
        r = m.record
        if m.failed:
            r["feasible"] = False
        else:
            r["feasible"] = True
            r["step_time_s"] = statistics.median(r["times_s"])
            if "predicted_peak_bytes" in r and r.get("peak_bytes"):
                r["prediction_error"] = r["predicted_peak_bytes"] / r["peak_bytes"] - 1
        points.append(r)
    return {"model": spec["name"], "points": points, **summarise(points)}


def summarise(points: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [p for p in points if p["feasible"] and p.get("peak_bytes") is not None]
    recompute = [p for p in ok if not p.get("offloaded_bytes") and p["label"] != "eager"]
    offload = [p for p in ok if p.get("offloaded_bytes")]
    eager = next(p for p in ok if p["label"] == "eager")
    lowest_recompute = min(recompute, key=lambda p: p["peak_bytes"])
    lowest_offload = min(offload, key=lambda p: p["peak_bytes"]) if offload else None
    equal_peak = []
    for p in offload:
        near = [
            q
            for q in recompute
            if abs(q["peak_bytes"] - p["peak_bytes"]) <= PEAK_TOLERANCE * p["peak_bytes"]
        ]
        if near:
            q = min(near, key=lambda q: q["step_time_s"])
            equal_peak.append(
                {
                    "offload": p["label"],
                    "recompute_only": q["label"],
                    "peak_mib": [p["peak_bytes"] / 2**20, q["peak_bytes"] / 2**20],
                    "time_ratio": p["step_time_s"] / q["step_time_s"],
                }
            )
    errors = [abs(p["prediction_error"]) for p in ok if "prediction_error" in p]
    return {
        "eager_peak_bytes": eager["peak_bytes"],
        "eager_step_time_s": eager["step_time_s"],
        "lowest_peak_recompute_only": {
            "label": lowest_recompute["label"],
            "peak_bytes": lowest_recompute["peak_bytes"],
            "step_time_s": lowest_recompute["step_time_s"],
        },
        "lowest_peak_with_offload": None
        if lowest_offload is None
        else {
            "label": lowest_offload["label"],
            "peak_bytes": lowest_offload["peak_bytes"],
            "step_time_s": lowest_offload["step_time_s"],
        },
        "equal_peak": equal_peak,
        "max_prediction_error": max(errors) if errors else None,
    }


def run_max_batch(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    model = resnet50_like().to(args.device)
    x = torch.randn(8, 3, 32, 32, device=args.device)
    work = Workload(model, (x,), {}, _xent0)
    budget = args.max_batch_budget
    results = []
    for policy in (
        Policy("none"),
        Policy("memory"),
        Policy("swap"),
        Policy("memory", offload=True),
    ):
        t0 = time.perf_counter()

        def probe(batch: int, policy: Policy = policy) -> Any:
            p = measure_probe(work, policy, args.device, budget, 0, batch)
            print(f"  max batch {policy.label}: {batch} {'fits' if p.fits else 'over'}", flush=True)
            return p

        found = search_max_batch(
            probe, label=policy.label, budget_bytes=budget, start=8, limit=args.max_batch_limit
        )
        results.append(
            {
                "policy": policy.label,
                "max_batch": found.max_batch,
                "total_bytes": found.total_bytes,
                "first_not_fitting": found.first_not_fitting,
                "capped": found.capped,
                "probes": [p.__dict__ for p in found.probes],
                "search_s": time.perf_counter() - t0,
            }
        )
        gc.collect()
    plain = results[0]["max_batch"]
    for r in results:
        r["vs_none"] = r["max_batch"] / plain if plain else None
    return {
        "model": "resnet50_like(base=16), 32x32, 10 classes",
        "parameters": sum(p.numel() for p in model.parameters()),
        "budget_bytes": budget,
        "covers": "parameters and buffers + batch + measured step peak (device tensors)",
        "results": results,
    }


def markdown(report: dict[str, Any]) -> str:
    link = report["link"]
    lines = [
        f"# Offload ({report['date_utc']}, {report['machine'].get('cpu_model', '')}, "
        f"torch {report['software']['torch']}, device {report['parameters']['device']})",
        "",
        f"Link to {link['to']}: out {link['out_bytes_per_s'] / 1e9:.2f} GB/s, in "
        f"{link['in_bytes_per_s'] / 1e9:.2f} GB/s, {link['latency_s'] * 1e3:.2f} ms per copy, "
        f"overlap with compute {link['overlap']:.2f} ({link['torch_threads']} torch threads).",
        "",
    ]
    for res in report["frontier"]:
        lines += [
            f"## {res['model']}",
            "",
            "| point | measured peak | predicted | offloaded | stall (pred.) | step time |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for p in res["points"]:
            if not p["feasible"]:
                lines.append(f"| {p['label']} | infeasible | | | | |")
                continue
            pred = p.get("predicted_peak_bytes")
            lines.append(
                f"| {p['label']} | {p['peak_bytes'] / 2**20:.1f} MiB | "
                f"{'' if pred is None else f'{pred / 2**20:.1f} MiB'} | "
                f"{p.get('offloaded_bytes', 0) / 2**20:.1f} MiB | "
                f"{p.get('predicted_stall_s', 0) * 1e3:.1f} ms | "
                f"{p['step_time_s'] * 1e3:.0f} ms |"
            )
        lo, lw = res["lowest_peak_recompute_only"], res["lowest_peak_with_offload"]
        lines += [
            "",
            f"Lowest peak, recompute only: {lo['peak_bytes'] / 2**20:.1f} MiB ({lo['label']}, "
            f"{lo['step_time_s'] * 1e3:.0f} ms); with offload: "
            + (
                "none"
                if lw is None
                else f"{lw['peak_bytes'] / 2**20:.1f} MiB ({lw['label']}, "
                f"{lw['step_time_s'] * 1e3:.0f} ms)"
            )
            + f"; eager {res['eager_peak_bytes'] / 2**20:.1f} MiB. Largest prediction error "
            f"{(res['max_prediction_error'] or 0):.1%}.",
            "",
        ]
        if res["equal_peak"]:
            lines += [
                "| offload point | recompute-only point within 5% | time ratio |",
                "| --- | --- | ---: |",
            ]
            for e in res["equal_peak"]:
                lines.append(f"| {e['offload']} | {e['recompute_only']} | {e['time_ratio']:.2f} |")
            lines.append("")
    mb = report.get("max_batch")
    if mb:
        lines += [
            f"## Largest batch within {mb['budget_bytes'] / 2**20:.0f} MiB ({mb['model']})",
            "",
            "| policy | max batch | vs none |",
            "| --- | ---: | ---: |",
        ]
        for r in mb["results"]:
            ratio = "" if r["vs_none"] is None else f"{r['vs_none']:.2f}x"
            lines.append(f"| {r['policy']} | {r['max_batch']} | {ratio} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one small model, two budgets, 3 rounds")
    p.add_argument("--rounds", type=int, help="interleaved timing rounds; default 7, --quick 3")
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-max-batch", action="store_true", help="skip the largest-batch search")
    p.add_argument("--max-batch-budget", type=int, default=96 * 2**20)
    p.add_argument("--max-batch-limit", type=int, default=4096)
    p.add_argument(
        "--out", "--out-dir", dest="out_dir", type=Path, default=ROOT / "benchmarks" / "results"
    )
    args = p.parse_args(argv)
    if args.rounds is None:
        args.rounds = 3 if args.quick else 7
    args.device = torch.device(args.device)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / ("offload" + ("_quick" if args.quick else ""))
    started, load_start = time.perf_counter(), load_average()
    print(
        f"offload benchmark on {args.device}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}"
    )
    frontier = []
    for spec in frontier_models(args.quick):
        frontier.append(run_frontier(spec, args))
    max_batch = None if args.no_max_batch or args.quick else run_max_batch(args)
    to = "host" if args.device.type == "cuda" else "disk"
    link = measure_link(to, args.device)
    report = {
        "benchmark": "offload",
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(args.device),
        "software": software_info(ROOT),
        "parameters": {
            "device": str(args.device),
            "offload_to": "host" if args.device.type == "cuda" else "disk",
            "rounds": args.rounds,
            "budget_fractions": list(QUICK_FRACTIONS if args.quick else FRACTIONS),
            "budget_meaning": "fraction of memfit 'none''s predicted step peak",
            "peak": "memfit.measure of one step after two warm-up steps",
            "time": "median of interleaved steps (memfit.bench.runner.time_interleaved)",
            "equal_peak_tolerance": PEAK_TOLERANCE,
        },
        "load_average": {"start": load_start, "end": load_average()},
        "link": {
            "to": to,
            "measured_by": "memfit.execution.offload.measure_link (32 MiB and 4 KiB round trips)",
            "out_bytes_per_s": link.out_bytes_per_s,
            "in_bytes_per_s": link.in_bytes_per_s,
            "latency_s": link.latency_s,
            "overlap": link.overlap,
            "torch_threads": torch.get_num_threads(),
        },
        "frontier": frontier,
        "max_batch": max_batch,
        "total_runtime_s": round(time.perf_counter() - started, 1),
    }
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    stem.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
