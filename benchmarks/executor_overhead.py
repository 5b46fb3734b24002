"""Where memfit's ``"none"`` step spends time that plain eager does not.

Why: ``"none"`` keeps every activation and recomputes nothing, so any time it takes beyond eager's
is the executor's overhead, paid by every plan. This script times, on the budget frontier's
models, in one process with interleaved rounds (medians; the shared runner,
``memfit.bench.runner``: each variant's first step and settling, then ``time_interleaved``):

* ``eager``: plain PyTorch;
* ``aot_eager``: ``torch.compile(backend="aot_eager")``: Dynamo, AOTAutograd's runtime and its
  default partition, run as FX code on eager kernels: the machinery memfit's eager executor
  shares, without memfit;
* ``memfit none``: ``memfit.checkpoint(model, "none")`` (eager executor);
* ``memfit none, attention off``: the same without rewriting attention;
* ``memfit-inductor none`` and ``torch.compile`` (Inductor), for the fused executors.

and attributes the difference from one profiled step of each (``torch.profiler``, CPU): the
number of ATen ops run, their summed self time (kernels and dispatch), the rest of the step
(Python: module calls, FX code, AOTAutograd's wrappers, the autograd engine), and the ops whose
count or time differ most from eager's.

``--models tiny`` adds a two-layer MLP on a 4x16 batch, whose step is almost all per-call cost
(Dynamo's guards, the wrappers' Python, the autograd engine): each timed sample there is the mean
of ``TINY_REPEAT`` steps, each from gradients set to None, so microseconds are resolved.

Writes ``benchmarks/results/executor_overhead.{json,md}`` (``--out`` elsewhere; ``--quick``: the
tiny model, 5 rounds, into ``executor_overhead_quick.*``).
Run: ``python benchmarks/executor_overhead.py [--quick] [--rounds 15] [--models resnet transformer
unet tiny]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import memfit  # noqa: E402
from budget_frontier import MODELS, ModelSpec, model_specs  # noqa: E402
from memfit.bench import environment  # noqa: E402
from memfit.bench.environment import load_average  # noqa: E402
from memfit.bench.peers import entry_point  # noqa: E402
from memfit.bench.runner import Method, time_interleaved, warm_up  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

#: Steps per timed sample of the ``tiny`` model (one step there takes 0.1-0.5 ms).
TINY_REPEAT = 50
CHOICES = (*MODELS, "tiny")

VARIANTS = (
    "eager",
    "aot_eager",
    "memfit none",
    "memfit none, attention off",
    "memfit-inductor none",
    "torch.compile",
)


def _wrap(variant: str, model: torch.nn.Module, tag: str) -> torch.nn.Module:
    entry = entry_point(model, tag)
    if variant == "eager":
        return model
    if variant == "aot_eager":
        return torch.compile(entry, backend="aot_eager")  # type: ignore[return-value]
    if variant == "torch.compile":
        return torch.compile(entry)  # type: ignore[return-value]
    if variant == "memfit none":
        return memfit.checkpoint(entry, "none")
    if variant == "memfit none, attention off":
        return memfit.checkpoint(entry, "none", options=memfit.Options(attention="off"))
    if variant == "memfit-inductor none":
        return memfit.checkpoint(entry, "none", executor="inductor")
    raise ValueError(variant)


def _profile(step: Callable[[], None]) -> dict[str, Any]:
    """One step under the CPU profiler: ATen op count and self time, the rest, by op."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        step()
        wall = time.perf_counter() - t
    by_op: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.name.startswith("aten::"):
            by_op[e.name][0] += 1
            by_op[e.name][1] += e.self_cpu_time_total / 1e6
    op_s = sum(v[1] for v in by_op.values())
    return {
        "profiled_wall_s": wall,
        "aten_ops": int(sum(v[0] for v in by_op.values())),
        "aten_self_s": op_s,
        "rest_s": wall - op_s,
        "by_op": {k: {"count": int(v[0]), "self_s": v[1]} for k, v in by_op.items()},
    }


def _differences(base: dict[str, Any], other: dict[str, Any], top: int = 8) -> list[str]:
    ops = set(base["by_op"]) | set(other["by_op"])
    zero = {"count": 0, "self_s": 0.0}
    rows = []
    for op in ops:
        b, o = base["by_op"].get(op, zero), other["by_op"].get(op, zero)
        rows.append((o["self_s"] - b["self_s"], o["count"] - b["count"], op))
    rows.sort(key=lambda r: -abs(r[0]))
    return [f"{op} {dc:+d} calls {ds * 1e3:+.1f} ms" for ds, dc, op in rows[:top]]


def tiny_spec() -> ModelSpec:
    """Two linear layers on a 4x16 batch: a step that is almost all per-call overhead."""

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    return ModelSpec(
        name="tiny",
        description="nn.Sequential(Linear(16, 16), ReLU, Linear(16, 4)), batch 4x16, loss "
        f"sum(out); each sample the mean of {TINY_REPEAT} steps",
        build=build,
        inputs=(torch.randn(4, 16, generator=torch.Generator().manual_seed(0)),),
        loss=lambda out: out.sum(),
        config={"repeat": TINY_REPEAT},
        sequence_length=None,
    )


def run_model(name: str, rounds: int) -> dict[str, Any]:
    spec = tiny_spec() if name == "tiny" else next(s for s in model_specs(False) if s.name == name)
    repeat = TINY_REPEAT if name == "tiny" else 1
    torch.compiler.reset()
    methods: list[Method] = []
    singles: dict[str, Callable[[], None]] = {}  # one step each, for the profile
    for variant in VARIANTS:
        model = spec.build()
        module = _wrap(variant, model, f"{name}_{variant}".replace(" ", "_").replace(",", ""))

        def single(module: torch.nn.Module = module) -> None:
            spec.loss(module(*spec.inputs)).backward()

        def step(model: torch.nn.Module = model, single: Callable[[], None] = single) -> None:
            for i in range(repeat):
                if i:  # every step from no gradients, as after optimizer.zero_grad(): no step
                    model.zero_grad(set_to_none=True)  # accumulates (the runner zeroes the first)
                single()

        method = Method(variant, model, step, module=module)
        singles[variant] = single
        warm_up(method)  # compile, and for memfit its settling steps
        method.run_step()  # and one step more, warm
        methods.append(method)
        print(f"  {name}: {variant} ready", flush=True)
    time_interleaved(methods, rounds)
    times = {m.name: [t / repeat for t in m.times] for m in methods}
    profiles = {}
    for method in methods[:3]:  # eager, aot_eager, memfit none
        method.zero_grad()
        profiles[method.name] = _profile(singles[method.name])
    eager = statistics.median(times["eager"])
    rows = []
    for method in methods:
        row: dict[str, Any] = {"variant": method.name}
        if method.failed:
            row.update(error=method.record["error"], error_phase=method.record["error_phase"])
            rows.append(row)
            continue
        median = statistics.median(times[method.name])
        row.update(time_s=median, time_vs_eager=median / eager)
        if method.name in profiles:
            row.update({k: v for k, v in profiles[method.name].items() if k != "by_op"})
            if method.name != "eager":
                row["largest_differences_vs_eager"] = _differences(
                    profiles["eager"], profiles[method.name]
                )
        rows.append(row)
        print(f"  {name}: {method.name:<28} {median * 1e3:7.3f} ms  {median / eager:.3f}x")
    return {"name": name, "description": spec.description, "rows": rows, "times_s": times}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model, 5 rounds")
    parser.add_argument("--rounds", type=int, help="interleaved rounds; default 15, --quick 5")
    parser.add_argument("--models", nargs="+", choices=CHOICES, help="default: the frontier's")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 5 if args.quick else 15
    if args.models is None:
        args.models = ["tiny"] if args.quick else list(MODELS)
    started, load_start = time.perf_counter(), load_average()
    results = [run_model(name, args.rounds) for name in args.models]
    report = environment.report(
        "executor_overhead", ROOT, started, load_start, results, rounds=args.rounds
    )
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / ("executor_overhead_quick" if args.quick else "executor_overhead")
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"# Executor overhead ({report['date_utc']})",
        "",
        f"CPU ({report['machine'].get('cpu_model', report['machine']['processor'])}), torch "
        f"{torch.__version__}, {report['threads']} threads, median of {args.rounds} interleaved "
        f"rounds; load average {load_start} at start, {report['load_average']['end']} at end. "
        "Profiled columns come from one step under torch.profiler (which slows every op "
        "alike): ATen ops run, their summed self time, and the rest of the step (Python: "
        "module calls, FX code, AOTAutograd's runtime, the autograd engine).",
        "",
    ]
    for res in results:
        lines += [
            f"## {res['name']}",
            "",
            res["description"],
            "",
            "| variant | step ms | / eager | ATen ops | ATen self ms | rest ms | largest "
            "differences from eager (profiled) |",
            "|---|---:|---:|---:|---:|---:|---|",
        ]
        for row in res["rows"]:
            if "error" in row:
                lines.append(f"| {row['variant']} | failed: {row['error'][:120]} | | | | | |")
                continue
            prof = (
                f"{row['aten_ops']} | {row['aten_self_s'] * 1e3:.1f} | {row['rest_s'] * 1e3:.1f}"
                if "aten_ops" in row
                else "- | - | -"
            )
            diffs = "; ".join(row.get("largest_differences_vs_eager", []))
            lines.append(
                f"| {row['variant']} | {row['time_s'] * 1e3:.3g} | {row['time_vs_eager']:.3f} "
                f"| {prof} | {diffs} |"
            )
        lines.append("")
    stem.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
