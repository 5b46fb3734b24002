"""Depth sweep: peak memory and step time of one training step vs. ResNet depth.

Why: gradient checkpointing is about how activation memory grows with depth. Keeping everything
grows linearly in the number of blocks n; the textbook alternative, ``checkpoint_sequential`` with
sqrt(n) segments, keeps O(sqrt n) block boundaries plus one segment's activations. This benchmark
measures where memfit's modes land between those, and what they cost in time, on CIFAR-shaped
pre-activation ResNets (``memfit.bench.resnet.cifar_resnet``) from 9 to 129 residual blocks.

Methods, all training one step (forward, cross-entropy loss, backward) on the same batch:

* ``eager``                 plain PyTorch, no memfit: the reference every ratio is taken against;
* ``memfit-none``           ``memfit.checkpoint(model, "none")``: capture, nothing recomputed;
* ``memfit-speed``          ``memfit.checkpoint(model, "speed")``;
* ``memfit-memory``         ``memfit.checkpoint(model, "memory")``;
* ``checkpoint_sequential`` ``torch.utils.checkpoint.checkpoint_sequential`` over ``model.blocks``
                            with round(sqrt(n)) segments, ``use_reentrant=False`` (eager).

How: one process; per depth, Dynamo is reset once and each memfit mode wraps its own freshly
seeded copy of the model and compiles it with one warm-up step (timed: "first step", which is
capture + planning + one step). Every other method also gets one warm-up step. Then one run per
method with ``memfit.measure`` gives the peak (exact allocator accounting, deterministic), then
``--repeats`` rounds, round-robin over the methods (starting method rotated each round), of
``memfit.measure(..., profile_memory=False)`` give the step times; medians are reported.
Gradients are set to ``None`` before every measured step, as ``optimizer.zero_grad()`` does, so
each step allocates its gradients. A change in memfit's plan object or in Dynamo's graph count
during the measured runs (a recompile) is recorded in the JSON.

Outputs, in ``--out`` (default ``benchmarks/results``; a suffix such as ``_cuda`` for non-CPU
devices, ``_quick`` for ``--quick``): ``depth_sweep.json`` (machine, versions, parameters, every
number), ``depth_sweep.md`` (the full table, ratios to eager) and ``depth_sweep.png``. The README's
summary table, between ``<!-- depth-sweep:begin -->`` and ``<!-- depth-sweep:end -->`` (for CUDA
``depth-sweep_cuda``), is rewritten from the JSON when ``--readme``
names a README (default ``README.md`` for a full sweep, none for ``--quick``).

Timings on a shared CPU need ``OMP_WAIT_POLICY=PASSIVE`` (read when torch loads): with the default
(active) waiting, OpenMP threads spin at every barrier, and where another process holds a core a
2-thread step measured 40x slower (3 s instead of 75 ms). The ``memfit`` script and
``benchmarks/depth_sweep.py`` set it unless the environment already does.

Run: ``memfit bench depth-sweep [--quick] [--device cuda]`` or ``python benchmarks/depth_sweep.py``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

import memfit
from memfit.bench.environment import load_average, machine_info, software_info
from memfit.bench.failure import record_failure
from memfit.bench.resnet import CifarResNet, cifar_resnet

RESULTS = Path("benchmarks") / "results"
README = Path("README.md")

METHODS = ("eager", "memfit-none", "memfit-speed", "memfit-memory", "checkpoint_sequential")
DEFAULT_DEPTHS = (3, 6, 11, 22, 43)  # blocks per stage: 9, 18, 33, 66, 129 residual blocks
QUICK_DEPTHS = (2, 4, 8)
MIB = 2**20


class SequentialCheckpointed(nn.Module):
    """The peer: ``checkpoint_sequential`` over the model's residual blocks, sqrt(n) segments."""

    def __init__(self, model: CifarResNet, segments: int) -> None:
        super().__init__()
        self.model = model
        self.segments = segments

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.model.stem(x)
        h = checkpoint_sequential(self.model.blocks, self.segments, h, use_reentrant=False)
        return self.model.head(h)


# ----------------------------------------------------------------------------------- environment


def _graph_count() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Method:
    """One way of training the model: its module, its step, and what was measured."""

    def __init__(self, name: str, params: nn.Module, module: nn.Module,
                 x: torch.Tensor, y: torch.Tensor) -> None:
        self.name = name
        self.params = params  # the plain model whose gradients are reset
        self.module = module
        self.x, self.y = x, y
        self.record: dict[str, Any] = {"times_s": []}
        self.failed = False

    def step(self) -> None:
        loss = F.cross_entropy(self.module(self.x), self.y)
        loss.backward()

    def zero_grad(self) -> None:
        self.params.zero_grad(set_to_none=True)

    def fail(self, phase: str, err: BaseException) -> None:
        self.failed = True
        record_failure(self.record, self.name, phase, err)


def build_methods(bps: int, width: int, batch: int, device: torch.device,
                  segments: int) -> list[Method]:
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
        methods.append(Method(name, model, module, x, y))
    return methods


def warm_up(m: Method, device: torch.device) -> None:
    try:
        m.zero_grad()
        _sync(device)
        t0 = time.perf_counter()
        m.step()
        _sync(device)
        m.record["first_step_s"] = time.perf_counter() - t0
        if m.name.startswith("memfit-"):
            plan = m.module.plan
            m.record.update(
                predicted_peak_bytes=plan.predicted_peak_bytes,
                baseline_peak_bytes=plan.baseline_peak_bytes,
                kept_bytes=plan.kept_bytes,
                recompute_flops=plan.recompute_flops,
                forward_flops=plan.forward_flops,
                graphs=len(plan.graphs),
            )
    except Exception as err:  # noqa: BLE001 - recorded and reported, the sweep goes on
        m.fail("compiling (first step)", err)


def measure_peak(m: Method, device: torch.device) -> None:
    try:
        m.zero_grad()
        r = memfit.measure(m.step, device=device)
        m.record["peak_bytes"] = r.peak_bytes
        m.record["end_bytes"] = r.end_bytes
        m.record["profiled_time_s"] = r.time_s
    except Exception as err:  # noqa: BLE001
        m.fail("measuring memory", err)


def measure_time(m: Method, device: torch.device) -> None:
    try:
        m.zero_grad()
        r = memfit.measure(m.step, device=device, profile_memory=False)
        m.record["times_s"].append(r.time_s)
    except Exception as err:  # noqa: BLE001
        m.fail("timing", err)


def run_depth(bps: int, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    n_blocks = 3 * bps
    segments = max(1, round(math.sqrt(n_blocks)))
    torch._dynamo.reset()  # once per depth; the three memfit wraps below then coexist
    methods = build_methods(bps, args.width, args.batch, device, segments)
    t_depth = time.perf_counter()
    for m in methods:
        warm_up(m, device)
    plans = {m.name: m.module.plan for m in methods
             if m.name.startswith("memfit-") and not m.failed}
    graphs_before = _graph_count()

    for m in methods:
        if not m.failed:
            measure_peak(m, device)
    for rep in range(args.repeats):
        shift = rep % len(methods)
        for m in methods[shift:] + methods[:shift]:
            if not m.failed:
                measure_time(m, device)

    recompiled = _graph_count() != graphs_before
    out: dict[str, Any] = {
        "blocks_per_stage": bps,
        "blocks": n_blocks,
        "layers": 6 * bps + 2,
        "segments": segments,
        "parameters": sum(p.numel() for p in methods[0].params.parameters()),
        "dynamo_recompiled_during_measurement": recompiled,
        "seconds": time.perf_counter() - t_depth,
        "methods": {},
    }
    for m in methods:
        rec = m.record
        if rec["times_s"]:
            rec["time_s"] = statistics.median(rec["times_s"])
        if m.name in plans:
            rec["plan_changed_during_measurement"] = m.module.plan is not plans[m.name]
        out["methods"][m.name] = rec
    return out


# ----------------------------------------------------------------------------------- reporting


def _fmt_ratio(value: float | None, ref: float | None) -> str:
    return f"{value / ref:.2f}" if value is not None and ref else "-"


def markdown_table(results: list[dict[str, Any]]) -> str:
    head = ("| blocks | method | peak MiB | peak / eager | predicted MiB | step ms | "
            "time / eager | first step s | recompute % fwd |")
    lines = [head, "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for res in results:
        eager = res["methods"].get("eager", {})
        for name, rec in res["methods"].items():
            if "error" in rec:
                err = rec["error"].splitlines()[0][:120].replace("|", "\\|")
                lines.append(f"| {res['blocks']} | {name} | failed while {rec['error_phase']}: "
                             f"`{err}` | | | | | | |")
                continue
            peak, t = rec.get("peak_bytes"), rec.get("time_s")
            pred = rec.get("predicted_peak_bytes")
            frac = (f"{100 * rec['recompute_flops'] / rec['forward_flops']:.0f}"
                    if rec.get("forward_flops") else "-")
            label = name + (f" ({res['segments']} seg)" if name == "checkpoint_sequential" else "")
            cells = [
                str(res["blocks"]),
                label,
                f"{peak / MIB:.1f}" if peak is not None else "-",
                _fmt_ratio(peak, eager.get("peak_bytes")),
                f"{pred / MIB:.1f}" if pred is not None else "-",
                f"{t * 1e3:.0f}" if t is not None else "-",
                _fmt_ratio(t, eager.get("time_s")),
                f"{rec['first_step_s']:.1f}" if "first_step_s" in rec else "-",
                frac,
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
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
            ratios.append(rec["peak_bytes"] / eager["peak_bytes"] if eager.get("peak_bytes")
                          else math.nan)
            times.append(rec["time_s"] * 1e3)
            preds.append(rec.get("predicted_peak_bytes", math.nan) / MIB)
        if not xs:
            continue
        ax_peak.plot(xs, peaks, label=name, **style[name])
        if name.startswith("memfit-"):
            ax_peak.plot(xs, preds, linestyle=":", color=style[name]["color"], linewidth=1)
        ax_ratio.plot(xs, ratios, label=name, **style[name])
        ax_time.plot(xs, times, label=name, **style[name])
    ax_peak.set(xscale="log", yscale="log", xlabel="residual blocks",
                ylabel="peak tensor memory of one step (MiB)",
                title="peak memory (dotted: memfit's prediction)")
    ax_ratio.set(xscale="log", xlabel="residual blocks", ylabel="peak / eager peak",
                 title="peak memory relative to eager")
    ax_ratio.set_ylim(bottom=0)
    ax_time.set(xscale="log", yscale="log", xlabel="residual blocks",
                ylabel="step time, median (ms)", title="time of one training step")
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


# ----------------------------------------------------------------------------------- README


def _marker(suffix: str) -> tuple[str, str]:
    name = "depth-sweep" + suffix
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def readme_block(report: dict[str, Any]) -> str:
    """The README's summary of a sweep: one sentence of conditions, then peak and time ratios."""
    results = report["results"]
    params, machine = report["parameters"], report["machine"]
    errors = [abs(rec["predicted_peak_bytes"] - rec["peak_bytes"]) / MIB
              for res in results for name, rec in res["methods"].items()
              if name.startswith("memfit-") and "peak_bytes" in rec
              and "predicted_peak_bytes" in rec]
    worst = max(errors, default=0.0)
    where = (machine.get("gpu") or f"a {machine.get('cpu_count')}-core "
             f"{machine.get('cpu_model') or machine.get('processor')}")
    lines = [
        f"Peak memory of one training step relative to plain eager PyTorch (measured; memfit's "
        f"prediction is within {max(worst, 0.1):.1f} MiB of the measurement in every row), batch "
        f"{params['batch']}, width {params['width']}, {report['date_utc'][:10]}, torch "
        f"{report['software']['torch']} on {where}, {machine.get('torch_threads')} threads. "
        f"Step time is the median of {params['repeats']} interleaved runs.",
        "",
        "| blocks | eager peak | `none` | `speed` | `memory` | `checkpoint_sequential` (√n) | "
        "step time `none` / `speed` / `memory` / `checkpoint_sequential` vs eager |",
        "|---:|---:|---:|---:|---:|---:|---|",
    ]
    compared = METHODS[1:]
    for res in results:
        eager = res["methods"].get("eager", {})
        peaks = [_fmt_ratio(res["methods"].get(m, {}).get("peak_bytes"), eager.get("peak_bytes"))
                 for m in compared]
        times = [_fmt_ratio(res["methods"].get(m, {}).get("time_s"), eager.get("time_s"))
                 for m in compared]
        eager_peak = f"{eager['peak_bytes'] / MIB:.1f} MiB" if "peak_bytes" in eager else "-"
        lines.append(f"| {res['blocks']} | {eager_peak} | " + " | ".join(peaks)
                     + f" | {' / '.join(times)} |")
    return "\n".join(lines)


def replace_block(text: str, block: str, suffix: str = "") -> str:
    """``text`` with what lies between the sweep's markers replaced by ``block``.

    Raises ``ValueError`` if the markers are missing or out of order.
    """
    begin, end = _marker(suffix)
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < i:
        raise ValueError(f"no {begin} ... {end} markers in the README")
    return text[: i + len(begin)] + "\n" + block.strip("\n") + "\n" + text[j:]


def update_readme(path: Path, report: dict[str, Any], suffix: str = "") -> bool:
    """Rewrite the README's table from ``report``; False (and nothing written) without markers."""
    text = path.read_text()
    try:
        new = replace_block(text, readme_block(report), suffix)
    except ValueError:
        return False
    if new != text:
        path.write_text(new)
    return True


# ----------------------------------------------------------------------------------- main


def add_arguments(p: argparse.ArgumentParser, out: Path = RESULTS,
                  readme: Path | None = README) -> None:
    """The sweep's options, shared by ``memfit bench depth-sweep`` and the script."""
    p.add_argument("--depths", type=int, nargs="+", default=None, metavar="N",
                   help=f"blocks per stage (default {' '.join(map(str, DEFAULT_DEPTHS))}; "
                        f"--quick: {' '.join(map(str, QUICK_DEPTHS))})")
    p.add_argument("--quick", action="store_true",
                   help="small depths; outputs get '_quick' and the README is left alone")
    p.add_argument("--batch", type=int, default=32, help="batch size (default 32)")
    p.add_argument("--width", type=int, default=16, help="channels of the first stage (16)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per method (median)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (CPU); default: torch's default")
    p.add_argument("--out", "--out-dir", dest="out", type=Path, default=out, metavar="DIR",
                   help=f"directory for the JSON, Markdown and PNG (default {out})")
    p.add_argument("--readme", type=Path, default=None, metavar="PATH",
                   help=f"README whose table to rewrite (default {readme} for a full sweep, "
                        "none for --quick)")
    p.set_defaults(default_readme=readme)


def run(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Run the sweep described by ``args`` on ``device`` and write its files; returns the report."""
    if args.threads:
        torch.set_num_threads(args.threads)
    depths = args.depths or (QUICK_DEPTHS if args.quick else DEFAULT_DEPTHS)
    device_suffix = "" if device.type == "cpu" else f"_{device.type}"
    suffix = device_suffix + ("_quick" if args.quick else "")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"depth_sweep{suffix}"

    started = time.perf_counter()
    load_start = load_average()
    print(f"depth sweep on {device}: blocks per stage {list(depths)}, batch {args.batch}, "
          f"width {args.width}, {args.repeats} timed rounds, {torch.get_num_threads()} threads "
          f"(OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}), load average {load_start}",
          flush=True)
    results = []
    for bps in depths:
        res = run_depth(bps, args, device)
        results.append(res)
        summary = ", ".join(
            f"{name} {rec['peak_bytes'] / MIB:.0f} MiB {rec['time_s'] * 1e3:.0f} ms"
            if "time_s" in rec and "peak_bytes" in rec else f"{name} FAILED"
            for name, rec in res["methods"].items())
        print(f"  {res['blocks']:4d} blocks ({res['seconds']:.0f} s): {summary}", flush=True)

    total = time.perf_counter() - started
    report = {
        "benchmark": "depth_sweep",
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(device),
        "software": software_info(),
        "parameters": {
            "model": "memfit.bench.resnet.cifar_resnet (pre-activation CIFAR ResNet v2, "
                     "BatchNorm)",
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
            "checkpoint_sequential": "model.blocks, round(sqrt(blocks)) segments, "
                                     "use_reentrant=False",
        },
        "load_average": {"start": load_start, "end": load_average()},
        "total_runtime_s": round(total, 1),
        "results": results,
    }
    json_path = stem.with_suffix(".json")
    json_path.write_text(json.dumps(report, indent=2) + "\n")

    title = (f"CIFAR ResNet, batch {args.batch}, width {args.width}, {device.type}"
             f" ({report['machine'].get('gpu') or report['machine'].get('cpu_model', '')})")
    table = markdown_table(results)
    md = (f"# Depth sweep ({report['date_utc']})\n\n{title}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}. Ratios are to plain eager "
          f"PyTorch; peak is "
          f"measured tensor memory of one training step; time is the median of {args.repeats}; "
          f"\"first step\" includes memfit's capture and planning.\n\n{table}\n\n"
          f"Total runtime {total:.0f} s.\n")
    stem.with_suffix(".md").write_text(md)
    write_plot(results, stem.with_suffix(".png"), title)
    print()
    print(table)
    print(f"\nwrote {json_path}, {stem.with_suffix('.md')}, {stem.with_suffix('.png')} "
          f"in {total:.0f} s total")

    readme = args.readme or (None if args.quick else args.default_readme)
    if readme is not None:
        if not readme.is_file():
            print(f"no README at {readme}: its table was not rewritten")
        elif update_readme(readme, report, device_suffix):
            print(f"rewrote the depth-sweep table in {readme}")
        else:
            begin, end = _marker(device_suffix)
            print(f"{readme} has no {begin} ... {end} markers: its table was not rewritten")
    return report


def main(argv: list[str] | None = None, out: Path = RESULTS, readme: Path | None = README) -> int:
    """Run the sweep as a script (``benchmarks/depth_sweep.py``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(p, out, readme)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    run(args, device)
    return 0
