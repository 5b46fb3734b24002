"""Depth sweep: peak memory and step time of one training step vs. ResNet depth.

Why: gradient checkpointing is about how activation memory grows with depth. Keeping everything
grows linearly in the number of blocks n; the textbook alternative, ``checkpoint_sequential`` with
sqrt(n) segments, keeps O(sqrt n) block boundaries plus one segment's activations. This benchmark
measures where memfit's policies land between those, and what they cost in time, on CIFAR-shaped
pre-activation ResNets (``memfit.bench.resnet.cifar_resnet``) from 9 to 129 residual blocks.

Methods, all training one step (forward, cross-entropy loss, backward) on the same batch:

* ``eager``                 plain PyTorch, no memfit: the reference every ratio is taken against;
* ``memfit-none``           ``memfit.checkpoint(model, "none")``: capture, nothing recomputed;
* ``memfit-speed``          ``memfit.checkpoint(model, "speed")``;
* ``memfit-memory``         ``memfit.checkpoint(model, "memory")``;
* ``checkpoint_sequential`` ``torch.utils.checkpoint.checkpoint_sequential`` over ``model.blocks``
                            with round(sqrt(n)) segments, ``use_reentrant=False`` (eager).

How: one process; per depth, Dynamo is reset once and each method trains its own freshly seeded
copy of the model, measured by ``memfit.bench.runner``: one first step (for memfit: capture,
planning and compilation, timed as "first step"), one step under ``memfit.measure`` for the peak
(exact allocator accounting, deterministic), then ``--repeats`` rounds of
``memfit.measure(..., profile_memory=False)``, round-robin over the methods with the starting
method rotated each round, for the step times; medians are reported. Gradients are set to
``None`` before every step, as ``optimizer.zero_grad()`` does, so each step allocates its
gradients. A change in memfit's plan object or in Dynamo's graph count during the measured runs
(a recompile) is recorded in the JSON.

Outputs, in ``--out`` and nowhere else (``memfit bench depth-sweep``: default
``memfit-bench`` in the temporary directory; a suffix such as ``_cuda`` for non-CPU devices,
``_quick`` for ``--quick``): ``depth_sweep.json`` (machine, versions, parameters, every number),
``depth_sweep.md`` (the full table, ratios to eager) and ``depth_sweep.png``. The repository's
script ``benchmarks/depth_sweep.py`` writes to ``benchmarks/results`` and also rewrites the
summary table in ``benchmarks/README.md``; the installed package never touches a README.

Timings on a shared CPU need ``OMP_WAIT_POLICY=PASSIVE`` (read when torch loads): with the default
(active) waiting, OpenMP threads spin at every barrier, and where another process holds a core a
2-thread step measured 40x slower (3 s instead of 75 ms). The ``memfit`` script and
``benchmarks/depth_sweep.py`` set it unless the environment already does.

Run: ``memfit bench depth-sweep [--quick] [--device cuda] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit.bench.environment import load_average, machine_info, software_info
from memfit.bench.peers import SequentialCheckpointed
from memfit.bench.resnet import cifar_resnet
from memfit.bench.runner import Method, Snapshot, measure_peaks, time_interleaved, warm_up
from memfit.units import MIB

__all__ = [
    "DEFAULT_OUT",
    "METHODS",
    "add_arguments",
    "build_methods",
    "format_ratio",
    "markdown_table",
    "run",
    "run_depth",
    "write_plot",
]

#: Where ``memfit bench depth-sweep`` writes without ``--out``: outside the working tree.
DEFAULT_OUT = Path(tempfile.gettempdir()) / "memfit-bench"

METHODS = ("eager", "memfit-none", "memfit-speed", "memfit-memory", "checkpoint_sequential")
DEFAULT_DEPTHS = (3, 6, 11, 22, 43)  # blocks per stage: 9, 18, 33, 66, 129 residual blocks
QUICK_DEPTHS = (2, 4, 8)


def _train_step(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        F.cross_entropy(module(x), y).backward()

    return step


# ----------------------------------------------------------------------------------- one depth


def build_methods(
    bps: int, width: int, batch: int, device: torch.device, segments: int
) -> list[Method]:
    """One method per entry of ``METHODS``, each on its own identically seeded ResNet."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, 32, 32, generator=gen).to(device)
    y = torch.randint(0, 10, (batch,), generator=gen).to(device)
    methods = []
    for name in METHODS:
        torch.manual_seed(0)  # every method trains identical weights
        model = cifar_resnet(bps, width).to(device)
        if name.startswith("memfit-"):
            module: nn.Module = memfit.checkpoint(model, name.removeprefix("memfit-"))
        elif name == "checkpoint_sequential":
            module = SequentialCheckpointed(model, segments)
        else:
            module = model
        methods.append(Method(name, model, _train_step(module, x, y), module))
    return methods


def run_depth(bps: int, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Every method at ``bps`` blocks per stage: first step, peak, interleaved step times."""
    n_blocks = 3 * bps
    segments = max(1, round(math.sqrt(n_blocks)))
    torch.compiler.reset()  # once per depth; the three memfit wraps below then coexist
    methods = build_methods(bps, args.width, args.batch, device, segments)
    t_depth = time.perf_counter()
    for m in methods:
        warm_up(m, device)
    before = Snapshot(methods)
    measure_peaks(methods, device)
    time_interleaved(methods, args.repeats, device)

    out: dict[str, Any] = {
        "blocks_per_stage": bps,
        "blocks": n_blocks,
        "layers": 6 * bps + 2,
        "segments": segments,
        "parameters": sum(p.numel() for p in methods[0].model.parameters()),
        "dynamo_recompiled_during_measurement": before.graphs_compiled() != 0,
        "seconds": time.perf_counter() - t_depth,
        "methods": {},
    }
    for m in methods:
        rec = m.record
        if m.times:
            rec["time_s"] = statistics.median(m.times)
        changed = before.plan_changed(m)
        if changed is not None:
            rec["plan_changed_during_measurement"] = changed
        out["methods"][m.name] = rec
    return out


# ----------------------------------------------------------------------------------- reporting


def format_ratio(value: float | None, ref: float | None) -> str:
    """``value / ref`` to two decimals, or ``-`` where either is missing."""
    return f"{value / ref:.2f}" if value is not None and ref else "-"


def markdown_table(results: list[dict[str, Any]]) -> str:
    head = (
        "| blocks | method | peak MiB | peak / eager | predicted MiB | step ms | "
        "time / eager | first step s | recompute % fwd |"
    )
    lines = [head, "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for res in results:
        eager = res["methods"].get("eager", {})
        for name, rec in res["methods"].items():
            if "error" in rec:
                err = rec["error"].splitlines()[0][:120].replace("|", "\\|")
                lines.append(
                    f"| {res['blocks']} | {name} | failed while {rec['error_phase']}: "
                    f"`{err}` | | | | | | |"
                )
                continue
            peak, t = rec.get("peak_bytes"), rec.get("time_s")
            pred = rec.get("predicted_peak_bytes")
            frac = (
                f"{100 * rec['recompute_flops'] / rec['forward_flops']:.0f}"
                if rec.get("forward_flops")
                else "-"
            )
            label = name + (f" ({res['segments']} seg)" if name == "checkpoint_sequential" else "")
            cells = [
                str(res["blocks"]),
                label,
                f"{peak / MIB:.1f}" if peak is not None else "-",
                format_ratio(peak, eager.get("peak_bytes")),
                f"{pred / MIB:.1f}" if pred is not None else "-",
                f"{t * 1e3:.0f}" if t is not None else "-",
                format_ratio(t, eager.get("time_s")),
                f"{rec['first_step_s']:.1f}" if "first_step_s" in rec else "-",
                frac,
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
    # Imported here, for the plot alone: matplotlib.pyplot took 5 s to import on a loaded CPU.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    style = {
        "eager": dict(color="black", marker="o"),
        "memfit-none": dict(color="tab:gray", marker="s"),
        "memfit-speed": dict(color="tab:blue", marker="^"),
        "memfit-memory": dict(color="tab:green", marker="v"),
        "checkpoint_sequential": dict(color="tab:orange", marker="D"),
    }
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    ax_peak, ax_ratio, ax_time = axes
    for name in METHODS:
        xs, peaks, ratios, times, preds = [], [], [], [], []
        for res in results:
            rec, eager = res["methods"].get(name, {}), res["methods"].get("eager", {})
            if "peak_bytes" not in rec or "time_s" not in rec:
                continue
            xs.append(res["blocks"])
            peaks.append(rec["peak_bytes"] / MIB)
            ratios.append(
                rec["peak_bytes"] / eager["peak_bytes"] if eager.get("peak_bytes") else math.nan
            )
            times.append(rec["time_s"] * 1e3)
            preds.append(rec.get("predicted_peak_bytes", math.nan) / MIB)
        if not xs:
            continue
        ax_peak.plot(xs, peaks, label=name, **style[name])
        if name.startswith("memfit-"):
            ax_peak.plot(xs, preds, linestyle=":", color=style[name]["color"], linewidth=1)
        ax_ratio.plot(xs, ratios, label=name, **style[name])
        ax_time.plot(xs, times, label=name, **style[name])
    for ax, yscale, ylabel, title in (
        (ax_peak, "log", "peak tensor memory of one step (MiB)",
         "peak memory (dotted: memfit's prediction)"),
        (ax_ratio, "linear", "peak / eager peak", "peak memory relative to eager"),
        (ax_time, "log", "step time, median (ms)", "time of one training step"),
    ):  # fmt: skip
        ax.set(xscale="log", yscale=yscale, xlabel="residual blocks", ylabel=ylabel, title=title)
    ax_ratio.set_ylim(bottom=0)
    blocks = [res["blocks"] for res in results]
    for ax in axes:
        ax.set_xticks(blocks, [str(b) for b in blocks])
        ax.xaxis.set_minor_locator(ticker.NullLocator())
        ax.grid(True, alpha=0.3)
    for ax in (ax_peak, ax_time):  # log y: label 1-2-5 steps, not only decades
        ax.yaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_locator(ticker.NullLocator())
    ax_peak.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------- main


def add_arguments(p: argparse.ArgumentParser, out: Path = DEFAULT_OUT) -> None:
    """The sweep's options, shared by ``memfit bench depth-sweep`` and the script."""
    p.add_argument(
        "--depths",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help=f"blocks per stage (default {' '.join(map(str, DEFAULT_DEPTHS))}; "
        f"--quick: {' '.join(map(str, QUICK_DEPTHS))})",
    )
    p.add_argument("--quick", action="store_true", help="small depths; outputs get '_quick'")
    p.add_argument("--batch", type=int, default=32, help="batch size (default 32)")
    p.add_argument("--width", type=int, default=16, help="channels of the first stage (16)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per method (median)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads (CPU); default: torch's default",
    )
    p.add_argument(
        "--out",
        "--out-dir",
        dest="out",
        type=Path,
        default=out,
        metavar="DIR",
        help=f"directory for the JSON, Markdown and PNG (default {out})",
    )


def run(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Run the sweep described by ``args`` on ``device`` and write its files in ``args.out``
    (nowhere else); returns the report."""
    if args.threads:
        torch.set_num_threads(args.threads)
    depths = args.depths or (QUICK_DEPTHS if args.quick else DEFAULT_DEPTHS)
    device_suffix = "" if device.type == "cpu" else f"_{device.type}"
    suffix = device_suffix + ("_quick" if args.quick else "")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"depth_sweep{suffix}"

    started = time.perf_counter()
    load_start = load_average()
    print(
        f"depth sweep on {device}: blocks per stage {list(depths)}, batch {args.batch}, "
        f"width {args.width}, {args.repeats} timed rounds, {torch.get_num_threads()} threads "
        f"(OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}), load average {load_start}",
        flush=True,
    )
    results = []
    for bps in depths:
        res = run_depth(bps, args, device)
        results.append(res)
        summary = ", ".join(
            f"{name} {rec['peak_bytes'] / MIB:.0f} MiB {rec['time_s'] * 1e3:.0f} ms"
            if "time_s" in rec and "peak_bytes" in rec
            else f"{name} FAILED"
            for name, rec in res["methods"].items()
        )
        print(f"  {res['blocks']:4d} blocks ({res['seconds']:.0f} s): {summary}", flush=True)

    total = time.perf_counter() - started
    report: dict[str, Any] = {
        "benchmark": "depth_sweep",
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(device),
        "software": software_info(),
        "parameters": _parameters(args, depths, device),
        "load_average": {"start": load_start, "end": load_average()},
        "total_runtime_s": round(total, 1),
        "results": results,
    }
    json_path = stem.with_suffix(".json")
    json_path.write_text(json.dumps(report, indent=2) + "\n")

    title = (
        f"CIFAR ResNet, batch {args.batch}, width {args.width}, {device.type}"
        f" ({report['machine'].get('gpu') or report['machine'].get('cpu_model', '')})"
    )
    table = markdown_table(results)
    md = _markdown(report, title, table, args.repeats, total)
    stem.with_suffix(".md").write_text(md)
    write_plot(results, stem.with_suffix(".png"), title)
    print()
    print(table)
    print(
        f"\nwrote {json_path}, {stem.with_suffix('.md')}, {stem.with_suffix('.png')} "
        f"in {total:.0f} s total"
    )

    return report


def _parameters(
    args: argparse.Namespace, depths: Sequence[int], device: torch.device
) -> dict[str, Any]:
    """The report's ``parameters``: what was run, and how peak and time were measured."""
    return {
        "model": "memfit.bench.resnet.cifar_resnet (pre-activation CIFAR ResNet v2, BatchNorm)",
        "input": [args.batch, 3, 32, 32],
        "batch": args.batch,
        "width": args.width,
        "blocks_per_stage": list(depths),
        "repeats": args.repeats,
        "device": str(device),
        "dtype": "float32",
        "step": "forward + cross_entropy + backward; grads set to None before each step",
        "peak": "memfit.measure, one run (exact, deterministic)",
        "time": "median of repeats, memfit.measure(profile_memory=False), round-robin",
        "checkpoint_sequential": "model.blocks, round(sqrt(blocks)) segments, use_reentrant=False",
    }


def _markdown(report: dict[str, Any], title: str, table: str, repeats: int, total: float) -> str:
    """The Markdown page of the sweep: what ran, how it was measured, and the table."""
    return (
        f"# Depth sweep ({report['date_utc']})\n\n{title}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}. Ratios are to plain eager "
        f"PyTorch; peak is "
        f"measured tensor memory of one training step; time is the median of {repeats}; "
        f'"first step" includes memfit\'s capture and planning.\n\n{table}\n\n'
        f"Total runtime {total:.0f} s.\n"
    )
