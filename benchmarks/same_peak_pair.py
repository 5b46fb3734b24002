"""memfit points against ``torch.compile`` points, head to head in one process.

Why: the budget frontier times some 26 points round-robin, so each point's median carries the
noise of a long run on a shared machine, and on the ResNet memfit's points came out 1.00x in one
41-step run and 1.03x in the next against ``torch.compile``'s 33.7 MiB program, whose peak
memfit's ``budget=0.6`` plan reaches to the byte. This script takes just a few (by default that
pair) and measures them by the frontier's own protocol (``memfit.bench.runner``: first step,
exact peak, interleaved timing, the order rotating every round), and reports the median and the
fastest step of each and the median over rounds of its step time over the first side's in the
same round (which cancels the drift of a shared machine's speed), then profiles a few steps of
each (``torch.profiler``) to say where a difference lies: in the kernels, or in the Python
around them (AOTAutograd's runtime wrappers, memfit's own). With several memfit settings it
answers in minutes what the frontier answers in half an hour: whether the plan a setting chose
is as fast as another of the same or a lower peak.

On a GPU (``--device cuda``, ``--batch-scale 8`` for the frontier's GPU sizes) it says more: the
GPU frontiers' steps of 7-14 ms are bound by the host launching a few hundred kernels, and there
memfit's ``"none"`` measured 1.06-1.09x ``torch.compile``'s no-recompute program on its fastest
steps in all three GPU runs of the transformer (H200 twice, H100; CPU: 0.66x). So each side's
profile also counts, per step, the GPU kernels it runs, their busy time, the host's kernel
launches (``kernel_counts``), and, without the profiler, the time until the step's Python returns
against the time until the GPU is done and the GPU's own time for the step's kernels run back to
back (``host_and_gpu_times``): whether a difference is in what the GPU runs or in how fast the
host issues it. (On the H100 the profiler's sessions asking for the GPU's activity, each side's
second, saw no GPU event; the back-to-back time needs only CUDA events.) On CPU
``--kernel-events`` makes Inductor's C++ kernels profiler events
(``torch._inductor.config.cpp.enable_kernel_profile``, set before anything compiles; it adds a
record per kernel call, so time with it off), and the same table counts them; the report then
also lists, per side, the calls inside its compiled graphs that the first side does not make the
same number of times (``kernel_differences``): none, and the two ran one program.

Outputs ``benchmarks/results/same_peak_pair/<model>.{json,md}`` (``--out-dir``). Run with the
Python memfit is installed in: ``python benchmarks/same_peak_pair.py [--model resnet] [--sides
torch.compile:0.8 memfit:0.6 memfit:none ...] [--rounds 60]``; a side is ``torch.compile:`` an
``activation_memory_budget``, ``memfit:`` a budget fraction or a mode (``none``, ``speed``,
``memory``), ``memfit-autotune:`` a budget fraction timed against ``"speed"``'s plan
(``autotune=True``), or ``memfit-bare:`` a memfit setting whose compiled program is stepped
without memfit's Python per call (a diagnostic: ``side``); any of them as ``<peer>-undonated:``
compiles with ``torch._functorch.config.donated_buffer`` off, its backward reusing no saved
value's storage (a diagnostic: what donation is worth). Two sides take about two minutes on
2 cores for the ResNet, each further side about one more. ``--quick``: the budget frontier's
quick (tiny) models, 5 rounds, into ``<model>_quick.*``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as budget_frontier.py: before torch loads

import argparse  # noqa: E402
import datetime as dt  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from contextlib import AbstractContextManager, nullcontext  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402
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
from memfit.measurement.timing import synchronize  # noqa: E402

#: warm-up steps per side after the first
WARM_UP = 3
#: profiled steps per side
PROFILED = 5
#: CUDA: unprofiled steps per side timed for ``host_and_gpu_times``, each of its two ways
UNPROFILED = 20
#: CUDA: the side of the square matrices whose products keep the GPU busy while a step is issued
FILLER = 4096
#: ops listed per side in the profile
TOP_OPS = 12
#: kernels listed per side, by time (GPU) or calls (CPU)
TOP_KERNELS = 15
#: what the profiler names a compiled graph's call; on CPU its children are its kernels
_COMPILED_CALL = "## Call CompiledFxGraph"


#: memfit settings given by name rather than as a budget fraction
MODES = ("none", "speed", "memory")


#: the sides' peers
PEERS = ("torch.compile", "memfit", "memfit-autotune", "memfit-bare")

#: a peer's suffix for a side compiled with ``torch._functorch.config.donated_buffer`` off: its
#: backward writes no buffer of its own into a saved value (for torch.compile, AOTAutograd's
#: donated buffers; for memfit, ``execution.executors.DONATED``)
UNDONATED = "-undonated"


def parse_side(text: str) -> tuple[str, str]:
    """``"torch.compile:0.8"``, ``"memfit:0.6"`` / ``"memfit:none"``, ``"memfit-autotune:0.6"``
    (a budget with ``autotune=True``) or ``"memfit-bare:none"`` / ``"memfit-bare:0.6"`` (see
    ``side``) as (peer, setting)."""
    peer, _, setting = text.partition(":")
    base = peer.removesuffix(UNDONATED)
    if base not in PEERS or not setting:
        raise argparse.ArgumentTypeError(
            "a side is torch.compile:<budget>, memfit:<setting>, memfit-autotune:<budget> or "
            f"memfit-bare:<setting>, each peer also as <peer>{UNDONATED}"
        )
    takes_modes = base in ("memfit", "memfit-bare")
    if not (takes_modes and setting in MODES):
        try:
            float(setting)
        except ValueError:
            modes = f" or a mode {MODES}" if takes_modes else ""
            raise argparse.ArgumentTypeError(f"{text}: not a budget fraction{modes}") from None
    return peer, setting


def side(spec: ModelSpec, peer: str, setting: str) -> Method:
    """One side as a ``memfit.bench.runner`` method on its own copy of the model (``spec.build``
    is seeded), after its first step: for ``torch.compile`` under ``activation_memory_budget``,
    which must span compilation and the lazily compiled backward.

    ``memfit-bare`` plans and compiles as ``memfit`` does, through the wrapper, then steps by
    calling the wrapper's compiled program itself, without memfit's Python around each call
    (``PlannedCall.run``: contexts, bookkeeping, checks). A diagnostic, not a way to train (no
    budget check, no graph-break watch, no shape limit): where memfit's step is slower than
    ``torch.compile``'s on a step bound by the host, it says whether the time is memfit's Python
    per call (the bare side as fast as ``torch.compile``) or its compiled program (as slow as
    memfit's).
    """
    model = spec.build()
    entry = entry_point(model, f"pair_{peer}_{setting}")
    context: AbstractContextManager[Any] = nullcontext()
    mode = setting in MODES
    name_peer = peer
    undonated = peer.endswith(UNDONATED)
    peer = peer.removesuffix(UNDONATED)
    if peer == "torch.compile":
        module: Any = torch.compile(entry)
        context = activation_memory_budget(float(setting))
    elif mode:
        module = memfit.checkpoint(entry, setting, executor="inductor")
    else:
        autotune = peer == "memfit-autotune"
        module = memfit.checkpoint(
            entry, float(setting), executor="inductor", options=memfit.Options(autotune=autotune)
        )

    def step() -> None:
        spec.loss(module(*spec.inputs)).backward()

    name = f"{name_peer} mode {setting}" if mode else f"{name_peer} budget {float(setting):g}"
    method = Method(name, model, step, record_failures=False)
    donation = torch._functorch.config.patch(donated_buffer=not undonated)
    with context, donation:  # memfit may plan again during the warm-up: under the same patch
        warm_up(method, spec.device)
        for _ in range(WARM_UP):
            method.run_step()
    if peer == "memfit-bare":
        method.step = _bare_step(spec, module)
        method.run_step()
    return method


def _bare_step(spec: ModelSpec, module: Any) -> Any:
    """A training step calling ``module``'s compiled program (``PlannedCall.compiled``, as it
    stands after the warm-up steps) without ``PlannedCall.run`` around it (see ``side``)."""
    planned = module.memfit._planned
    compiled = planned.compiled

    def step() -> None:
        spec.loss(compiled(*spec.inputs)).backward()
        planned.session.ran.clear()  # what run() clears before each call: the graphs the call ran

    return step


def profile_side(method: Method, device: torch.device) -> dict[str, Any]:
    """One profiler session over ``PROFILED`` steps of ``method``: its ops by self CPU time
    (``"profile"``) and what ``kernel_counts`` reads of the same events (``"kernels"``); on CUDA
    then, unprofiled, ``host_and_gpu_times``.

    One session a side, the GPU's activity in it: the H100 run of 2026-11-27 profiled each side
    twice, CPU alone then CPU and CUDA, and its second sessions recorded no GPU event at all
    (``kernel_counts`` read 0 kernels and 0 launches on both sides), while the CUDA test of
    ``kernel_counts`` passed on the same machine, in another process; later sessions of a
    process are known to lose GPU events (pytorch/pytorch#175790, #192021). So each side's
    kernels also get a time that needs no profiler (``queued_gpu_ms``), and ``"events"`` records
    how many events of each device type the session saw. A side whose profile fails keeps its
    timings and says why (a GPU's minutes are few).
    """
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        with profile(activities=activities) as prof:
            for _ in range(PROFILED):
                method.run_step()
            synchronize(device)
        ops = sorted(
            (
                {
                    "op": e.key,
                    "calls_per_step": e.count / PROFILED,
                    "self_ms_per_step": e.self_cpu_time_total / PROFILED / 1e3,
                }
                for e in prof.key_averages()
            ),
            key=lambda r: -r["self_ms_per_step"],
        )
        kernels = kernel_counts(prof.events(), cuda)
    except Exception as err:  # noqa: BLE001 - recorded in the results, the rest goes on
        return {"profile": [], "kernels": _error(err)}
    if cuda:
        try:
            kernels.update(host_and_gpu_times(method, device))
        except Exception as err:  # noqa: BLE001 - as above
            kernels["error"] = _error(err)["error"]
    return {"profile": ops[:TOP_OPS], "kernels": kernels}


def _error(err: BaseException) -> dict[str, Any]:
    return {"error": f"{type(err).__name__}: {err}", "top_kernels": []}


def kernel_counts(events: Any, cuda: bool) -> dict[str, Any]:
    """Per step, from a profile of ``PROFILED`` steps: the kernels the steps ran.

    On CUDA: GPU kernels (and copies and fills) per step, their summed busy time, the host's
    kernel launch calls, and the kernels by time. On CPU: the calls made inside compiled graphs
    (their extern ATen calls, and their C++ kernels with ``--kernel-events``) and the ATen ops
    called outside them. Both: ``"events"``, the session's events per device type.
    """
    by_device = Counter(str(e.device_type).rpartition(".")[2] for e in events)
    if cuda:
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        busy: Counter[str] = Counter()
        for e in kernels:
            busy[e.name] += e.time_range.elapsed_us()
        calls = Counter(e.name for e in kernels)
        return {
            "events": dict(by_device),
            "kernels_per_step": len(kernels) / PROFILED,
            "gpu_busy_ms_per_step": sum(busy.values()) / PROFILED / 1e3,
            "launches_per_step": sum(
                1 for e in events if e.device_type == DeviceType.CPU and "LaunchKernel" in e.name
            )
            / PROFILED,
            "top_kernels": [
                {
                    "kernel": name,
                    "calls_per_step": calls[name] / PROFILED,
                    "ms_per_step": us / PROFILED / 1e3,
                }
                for name, us in busy.most_common(TOP_KERNELS)
            ],
        }
    compiled = [e for e in events if e.name.startswith(_COMPILED_CALL)]
    inside = Counter(c.name for e in compiled for c in e.cpu_children)
    outside = Counter(
        e.name
        for e in events
        if e.name.startswith("aten::")
        and not _within(e, _COMPILED_CALL)
        and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    )
    return {
        "events": dict(by_device),
        "compiled_graph_calls_per_step": len(compiled) / PROFILED,
        "calls_inside_compiled_per_step": sum(inside.values()) / PROFILED,
        "aten_calls_outside_compiled_per_step": sum(outside.values()) / PROFILED,
        "top_kernels": [
            {"kernel": name, "calls_per_step": n / PROFILED}
            for name, n in inside.most_common(TOP_KERNELS)
        ],
        # every call, for ``kernel_differences``
        "calls_inside": {name: n / PROFILED for name, n in sorted(inside.items())},
    }


def _kernel_kind(name: str) -> str:
    """A call's name with what differs between two compiles of one graph taken off: the
    ``graph_<n>_`` prefix ``torch.compile``'s kernels carry in the profiler and the index
    Inductor numbers a graph's kernels with (``cpp_fused_relu_3``: ``cpp_fused_relu``)."""
    return re.sub(r"_\d+$", "", re.sub(r"^graph_\d+_", "", name))


def _kinds(calls: dict[str, float]) -> Counter[str]:
    """Calls per step summed by ``_kernel_kind``."""
    kinds: Counter[str] = Counter()
    for name, n in calls.items():
        kinds[_kernel_kind(name)] += n
    return kinds


def _compare(reference: dict[str, float], other: dict[str, float]) -> tuple[list[list[Any]], float]:
    """``kernel_differences`` and ``common_calls`` of two sides, each side summed by kind once."""
    ref, oth = _kinds(reference), _kinds(other)
    differ = [[k, ref[k], oth[k]] for k in sorted(set(ref) | set(oth)) if ref[k] != oth[k]]
    return differ, sum(min(n, oth[k]) for k, n in ref.items())


def kernel_differences(reference: dict[str, float], other: dict[str, float]) -> list[list[Any]]:
    """The calls per step (``kernel_counts``' ``calls_inside``, by ``_kernel_kind``) that two
    sides do not share: ``[kind, reference's calls, other's calls]`` for each kind called a
    different number of times. Empty: both steps called the same kernels inside their compiled
    graphs, so they ran one program, and any difference in their times is not in what they
    compute (the ResNet's ``memfit:0.6`` and ``torch.compile:0.8``, but for one copy kernel).
    """
    return _compare(reference, other)[0]


def common_calls(reference: dict[str, float], other: dict[str, float]) -> float:
    """How many calls per step of ``kernel_differences``' two sides are shared."""
    return _compare(reference, other)[1]


def host_and_gpu_times(method: Method, device: torch.device) -> dict[str, Any]:
    """Medians over ``UNPROFILED`` steps each, no profiler running: the time until the step's
    Python returns (``issue_ms``) and until the GPU has finished it (``wall_ms``); then the GPU's
    own time for the step's work, its kernels run back to back (``queued_gpu_ms``).

    For the last, each step is issued while the GPU is still busy with matrix products queued
    before it, long enough to outlast the host's issuing of the whole step (three times the
    step's ``issue_ms``); CUDA events recorded just before and after the step then time only
    the GPU's work on it. ``queued_starved`` counts the steps whose start the GPU had reached
    before the host finished issuing them (then the GPU may have waited on the host inside the
    step, and the time includes that wait). A step bound by the host has ``wall_ms`` near
    ``issue_ms`` and ``queued_gpu_ms`` well below both; a difference between two sides in
    ``queued_gpu_ms`` is a difference in what the GPU runs, one only in ``issue_ms`` is the
    host's.
    """
    issue, wall = [], []
    for _ in range(UNPROFILED):
        method.zero_grad()
        synchronize(device)
        t0 = time.perf_counter()
        method.step()
        issue.append(time.perf_counter() - t0)
        synchronize(device)
        wall.append(time.perf_counter() - t0)
    issue_ms = statistics.median(issue) * 1e3

    a = torch.randn(FILLER, FILLER, device=device)
    b = torch.empty_like(a)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    for n in (1, 4):  # the first warms cuBLAS up; the second is timed
        start.record()
        for _ in range(n):
            torch.mm(a, a, out=b)
        end.record()
        end.synchronize()
    product_ms = start.elapsed_time(end) / 4
    products = math.ceil(3 * issue_ms / product_ms) + 1
    gpu, starved = [], 0
    for _ in range(UNPROFILED):
        method.zero_grad()
        synchronize(device)
        for _ in range(products):
            torch.mm(a, a, out=b)
        start.record()
        method.step()
        end.record()
        starved += int(start.query())  # the GPU got to the step before the host had issued it
        end.synchronize()
        gpu.append(start.elapsed_time(end))
    return {
        "issue_ms": issue_ms,
        "wall_ms": statistics.median(wall) * 1e3,
        "queued_gpu_ms": statistics.median(gpu),
        "queued_starved": starved,
        "filler_products": products,
    }


def _within(event: Any, prefix: str) -> bool:
    """Whether a profiler event runs inside one whose name starts with ``prefix``."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(prefix):
            return True
        parent = parent.cpu_parent
    return False


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
    p.add_argument("--quick", action="store_true", help="the frontier's tiny models, 5 rounds")
    p.add_argument("--rounds", type=int, help="default 60, --quick 5")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument(
        "--batch-scale", type=int, default=1, help="every batch times N (the GPU frontiers: 8)"
    )
    p.add_argument(
        "--kernel-events",
        action="store_true",
        help="CPU: Inductor's C++ kernels as profiler events, counted per side (slows them)",
    )
    p.add_argument(
        "--out", "--out-dir", dest="out_dir", type=Path, default=RESULTS / "same_peak_pair"
    )
    args = p.parse_args(argv)
    if args.rounds is None:
        args.rounds = 5 if args.quick else 60
    device = torch.device(args.device)
    if args.kernel_events:
        torch._inductor.config.cpp.enable_kernel_profile = True  # before anything compiles
    specs = model_specs(args.quick, device, args.batch_scale)
    (spec,) = [s for s in specs if s.name == args.model]
    stem = args.out_dir / (spec.name + ("_quick" if args.quick else ""))
    load_start = load_average()
    methods = [side(spec, peer, setting) for peer, setting in args.sides]
    measure_peaks(methods, device)
    time_interleaved(methods, rounds=args.rounds, device=device)  # the start rotates each round
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
            **profile_side(method, device),
        }
    record = {
        "benchmark": "same_peak_pair",
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "software": software_info(),
        "load_average": {"start": load_start, "end": load_average()},
        "model": spec.name,
        "description": spec.description,
        "device": str(device),
        "batch_scale": args.batch_scale,
        "kernel_events": args.kernel_events,
        "rounds": args.rounds,
        "quick": args.quick,
        "reference": reference.name,
        "sides": results,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(record, indent=2))
    names = [m.name for m in methods]
    title = " against ".join(reversed(names)) if len(names) == 2 else ", ".join(names)
    lines = [
        f"# {spec.name}: {title}, head to head ({record['date_utc']})",
        "",
        f"{spec.description}. {args.rounds} rounds in one process, each side one step per round "
        f"in an order rotating each round, on {_device_name(device)}, torch {torch.__version__}, "
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
    lines += ["", *kernel_table(results, device)]
    for name, r in results.items():
        lines += ["", f"## {name}: profile, per step", "", "| op | calls | self ms |"]
        lines.append("|---|---:|---:|")
        lines += [
            f"| {row['op'][:70]} | {row['calls_per_step']:g} | {row['self_ms_per_step']:.2f} |"
            for row in r["profile"]
        ]
    if args.kernel_events:
        lines += difference_sections(results, reference.name)
    for name, r in results.items():
        lines += ["", f"## {name}: kernels, per step", "", *kernel_list(r["kernels"])]
    text = "\n".join(lines) + "\n"
    stem.with_suffix(".md").write_text(text)
    print(text)
    return 0


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "CPU"


#: per device type, what ``kernel_table`` says of ``kernel_counts``'s figures, and its columns as
#: (column, key)
_KERNEL_TABLES: dict[str, tuple[str, tuple[tuple[str, str], ...]]] = {
    "cuda": (
        "Per step (`kernel_counts`): the GPU's kernels, copies and fills and their busy time, the "
        "kernel launch calls the profiler saw on the host; then, unprofiled "
        "(`host_and_gpu_times`), the time until the step's Python returns and until the GPU is "
        "done, and the GPU's time for the step issued behind queued work, its kernels back to "
        "back (of 20 steps, `starved` the ones the GPU reached before the host had issued them).",
        (
            ("GPU kernels, copies, fills", "kernels_per_step"),
            ("GPU busy ms", "gpu_busy_ms_per_step"),
            ("launch calls seen", "launches_per_step"),
            ("issued in ms", "issue_ms"),
            ("done in ms", "wall_ms"),
            ("GPU ms back to back", "queued_gpu_ms"),
            ("starved", "queued_starved"),
        ),
    ),
    "cpu": (
        "Per step (`kernel_counts`): compiled graphs called, the calls inside them (extern ATen "
        "ops; Inductor's C++ kernels only with `--kernel-events`), ATen ops called outside them.",
        (
            ("compiled graphs", "compiled_graph_calls_per_step"),
            ("calls inside them", "calls_inside_compiled_per_step"),
            ("ATen calls outside", "aten_calls_outside_compiled_per_step"),
        ),
    ),
}


def kernel_table(results: dict[str, Any], device: torch.device) -> list[str]:
    """Each side's ``kernel_counts`` in one table (a side whose profile failed: its error)."""
    caption, columns = _KERNEL_TABLES["cuda" if device.type == "cuda" else "cpu"]
    lines = [
        caption,
        "",
        "| side | " + " | ".join(c for c, _ in columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for name, r in results.items():
        k = r["kernels"]
        if "error" in k:
            lines.append(f"| {name} | {k['error'][:100]} |")
            continue
        lines.append(f"| {name} | " + " | ".join(f"{k[key]:.4g}" for _, key in columns) + " |")
    return lines


def difference_sections(results: dict[str, Any], reference: str) -> list[str]:
    """Per side, the calls inside its compiled graphs that differ from ``reference``'s
    (``kernel_differences``), as a section of the report."""
    lines: list[str] = []
    ref = results[reference]["kernels"].get("calls_inside")
    for name, r in results.items():
        calls = r["kernels"].get("calls_inside")
        if name == reference or ref is None or calls is None:
            continue
        differ, same = _compare(ref, calls)
        lines += [
            "",
            f"## {name}: calls per step inside its compiled graphs, against {reference}",
            "",
        ]
        if not differ:
            lines.append(f"The same {same:g} calls (kernels and extern ATen ops) as {reference}'s.")
            continue
        lines += [
            f"{same:g} calls in common; these differ (kernel names without Inductor's index):",
            "",
            f"| call | {reference} | {name} |",
            "|---|---:|---:|",
        ]
        lines += [f"| {kind} | {a:g} | {b:g} |" for kind, a, b in differ]
    return lines


def kernel_list(kernels: dict[str, Any]) -> list[str]:
    """One side's most frequent kernels (GPU: by time), as a table."""
    timed = any("ms_per_step" in k for k in kernels["top_kernels"])
    lines = [
        "| kernel | calls |" + (" ms |" if timed else ""),
        "|---|---:|" + ("---:|" if timed else ""),
    ]
    for k in kernels["top_kernels"]:
        ms = f" {k['ms_per_step']:.3f} |" if timed else ""
        lines.append(f"| {k['kernel'][:80]} | {k['calls_per_step']:g} |{ms}")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
