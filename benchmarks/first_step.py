"""What the first training step costs, end to end and per phase: memfit against torch.compile.

Why: memfit plans inside the user's first step (capture, op-scratch measurement, frontier,
simulation, splitting, compiling), so planning is only affordable while that step stays close to
what any ``torch.compile`` first step costs. Issue 11's target: the first step of ``"memory"`` and
of ``budget=`` at most 1.3x that of ``"none"`` (which captures and splits but has nothing to
decide), on a 400-layer MLP (~6,400 joint-graph nodes) and a 60-layer GPT-2; and the frontier
benchmark's ResNet (12 blocks with BatchNorm), where the Inductor executor's measured search tries
the most plans.

Each configuration runs in a fresh Python process (imports, Dynamo's and Inductor's caches in
memory all cold, as for a user's first step; Inductor's on-disk cache is pointed at a fresh
directory for every process, so every Inductor configuration really compiles), ``--repeats``
times, and the median is reported. A child times one training step from the first call to the
end of ``backward()`` and, for memfit, each phase by wrapping the functions that do it:

* ``op_scratch``: ``measure_op_memory`` (running each distinct op signature once);
* ``plan``: ``plan_graph`` (all of planning), of which ``frontier`` (``pareto_frontier``: the
  plans at every budget of the grid, each simulated) and ``simulate`` (the other simulations:
  the baseline and the chosen plan);
* ``split``: ``split_joint_graph`` (forward and backward graphs from the plan);
* ``compile``: ``compile_graph`` (FX code for the eager executor, Inductor for ``"inductor"``)
  and, for ``"inductor"``, ``compile_pair``: each plan the measured search tries is compiled
  while planning (``plans_compiled`` counts them);
* ``rest``: the step less all of these: Dynamo's capture, AOTAutograd's tracing, running.

Configurations: memfit ``"none"``, ``"memory"``, ``budget=1.0`` with the eager executor and with
the Inductor one (the planner computes the same frontier at any budget; on a ReLU MLP no plan
keeps less than plain autograd, so a smaller fraction is refused), and the Inductor one's
``budget=1.0`` with ``autotune=True`` (one more plan compiled where ``"speed"``'s keeps less, and
the two timed);
``torch.compile(backend="aot_eager")`` (capture and tracing without a compiler: the closest peer
of memfit's eager executor) and ``torch.compile()`` (Inductor).

Writes ``benchmarks/results/first_step.{json,md}`` (``--out`` elsewhere). Run with the Python of
the environment memfit is installed in: ``python benchmarks/first_step.py [--quick]`` (about 10
minutes on 2 cores per repeat; ``--quick``: a 40-layer MLP, memfit ``"none"`` and ``"memory"``
with each executor, one process each, into ``first_step_quick.*``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

CONFIGS = (
    "memfit none",
    "memfit memory",
    "memfit budget=1.0",
    "memfit-inductor none",
    "memfit-inductor memory",
    "memfit-inductor budget=1.0",
    "memfit-inductor budget=1.0 autotune",
    "torch.compile aot_eager",
    "torch.compile inductor",
)
MODELS = ("mlp-400", "gpt2-60", "resnet-4")
QUICK_MODELS = ("mlp-40",)
QUICK_CONFIGS = (
    "memfit none",
    "memfit memory",
    "memfit-inductor none",
    "memfit-inductor memory",
)
PHASES = ("op_scratch", "plan", "frontier", "simulate", "split", "compile")


def _build(name: str) -> tuple[Any, tuple[Any, ...], Callable[[Any], Any]]:
    """The model, its inputs and its loss; seeded."""
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    kind, size = name.rsplit("-", 1)
    if kind == "resnet":  # the frontier benchmark's ResNet: BatchNorm, convolutions
        from memfit.bench.zoo import cifar_resnet

        x = torch.randn(32, 3, 32, 32)
        y = torch.randint(0, 10, (32,))
        return (
            cifar_resnet(int(size), width=16),
            (x,),
            lambda out: nn.functional.cross_entropy(out, y),
        )
    if kind == "mlp":
        layers: list[nn.Module] = []
        for _ in range(int(size)):
            layers += [nn.Linear(64, 64), nn.ReLU()]
        return nn.Sequential(*layers), (torch.randn(32, 64),), lambda out: out.square().mean()
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=int(size), n_embd=64, n_head=4, n_positions=64, vocab_size=256, use_cache=False
    )
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    return GPT2LMHeadModel(config).train(), (ids,), lambda out: out.logits.square().mean()


def child(model_name: str, config: str) -> dict[str, Any]:
    """One first step of ``config`` on ``model_name`` in this (fresh) process, timed by phase."""
    import torch

    import memfit
    import memfit.execution.inductor_fit as inductor_fit
    import memfit.execution.partitioner as partitioner
    import memfit.execution.runners as runners
    import memfit.planning.planner as planner

    torch.set_num_threads(int(os.environ.get("FIRST_STEP_THREADS", "2")))
    model, inputs, loss = _build(model_name)
    spent = dict.fromkeys(PHASES, 0.0)
    calls: dict[str, int] = {}  # by wrapped function

    def timed(module: Any, attr: str, phase: str) -> None:
        inner = getattr(module, attr)
        calls[attr] = 0

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[attr] += 1
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[phase] += time.perf_counter() - t

        setattr(module, attr, wrapper)

    timed(partitioner, "measure_op_memory", "op_scratch")
    timed(partitioner, "plan_graph", "plan")
    timed(planner, "pareto_frontier", "frontier")
    timed(planner, "simulate_step", "simulate")
    timed(partitioner, "split_joint_graph", "split")
    timed(runners, "compile_graph", "compile")
    timed(inductor_fit, "compile_pair", "compile")  # each plan the measured search tries

    peer, setting = config.split(" ", 1)
    if peer == "torch.compile":
        wrapped = torch.compile(model, backend=setting)
    else:
        executor = "inductor" if peer == "memfit-inductor" else "eager"
        if setting.startswith("budget="):
            budget, _, tune = setting[7:].partition(" ")
            wrapped = memfit.checkpoint(
                model,
                float(budget),
                executor=executor,
                options=memfit.Options(autotune=tune == "autotune"),
            )
        else:
            wrapped = memfit.checkpoint(model, setting, executor=executor)
    t = time.perf_counter()
    loss(wrapped(*inputs)).backward()
    total = time.perf_counter() - t
    record: dict[str, Any] = {"model": model_name, "config": config, "first_step_s": total}
    if peer != "torch.compile":
        record["phases_s"] = dict(spent)
        named = spent["op_scratch"] + spent["plan"] + spent["split"] + spent["compile"]
        record["phases_s"]["rest"] = total - named
        record["plans_compiled"] = calls["compile_pair"]
        plan = wrapped.memfit.plan
        record["joint_nodes"] = sum(g.num_nodes for g in plan.graphs)
        record["predicted_peak_bytes"] = plan.predicted_peak_bytes
    return record


def run_fresh(script: str, *args: str) -> dict[str, Any]:
    """The JSON record ``script --child *args`` prints last, run in a fresh Python process with
    a fresh Inductor cache directory (nothing compiled before, as for a user's first step);
    ``{"error": its stderr's end}`` if it failed."""
    with tempfile.TemporaryDirectory(prefix="memfit-first-step-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONWARNINGS": "ignore"}
        out = subprocess.run(
            [sys.executable, script, "--child", *args],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"error": out.stderr[-2000:]}
    return json.loads(lines[-1])  # type: ignore[no-any-return]


def _run_child(model_name: str, config: str) -> dict[str, Any]:
    record = run_fresh(__file__, model_name, config)
    if "error" in record:
        return {"model": model_name, "config": config, **record}
    return record


def _median_record(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[-1]
    record = dict(ok[0])
    record["runs_s"] = [r["first_step_s"] for r in ok]
    record["first_step_s"] = statistics.median(record["runs_s"])
    if "phases_s" in record:
        record["phases_s"] = {
            k: statistics.median(r["phases_s"][k] for r in ok) for k in ok[0]["phases_s"]
        }
    return record


def _table(rows: list[dict[str, Any]]) -> str:
    header = (
        "| model | configuration | first step (s) | / its none | / its torch.compile "
        "| capture etc. | op scratch | plan (frontier, simulate) | split | compile "
        "| plans compiled |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    out = [header]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | {r['config']} | error | | | | | | | | |")
            continue
        inductor = r["config"].startswith(("memfit-inductor", "torch.compile inductor"))
        # each against the same executor's "none" and its torch.compile peer
        none_config = "memfit-inductor none" if inductor else "memfit none"
        peer_config = "torch.compile inductor" if inductor else "torch.compile aot_eager"
        base = next(
            (q for q in rows if q["model"] == r["model"] and q["config"] == none_config), None
        )
        aot = next(
            (q for q in rows if q["model"] == r["model"] and q["config"] == peer_config), None
        )

        def ratio(q: dict[str, Any] | None, r: dict[str, Any] = r) -> str:
            if q is None or "error" in q:
                return "-"
            return f"{r['first_step_s'] / q['first_step_s']:.2f}"

        p = r.get("phases_s")
        phases = (
            [
                f"{p['rest']:.1f}",
                f"{p['op_scratch']:.1f}",
                f"{p['plan']:.1f} ({p['frontier']:.1f}, {p['simulate']:.1f})",
                f"{p['split']:.1f}",
                f"{p['compile']:.1f}",
                str(r.get("plans_compiled", "-"))
                if r["config"].startswith("memfit-inductor")
                else "-",
            ]
            if p
            else ["-"] * 6
        )
        out.append(
            f"| {r['model']} | {r['config']} | {r['first_step_s']:.1f} | {ratio(base)} "
            f"| {ratio(aot)} | " + " | ".join(phases) + " |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small MLP, 4 configs, one repeat")
    parser.add_argument("--repeats", type=int, default=None, help="processes per point (3)")
    parser.add_argument("--models", nargs="+", default=None)
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, help="default: all (--quick: 4)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)), flush=True)
        return 0
    import torch

    from memfit.bench.environment import load_average, machine_info, software_info

    models = args.models or list(QUICK_MODELS if args.quick else MODELS)
    args.configs = args.configs or list(QUICK_CONFIGS if args.quick else CONFIGS)
    repeats = args.repeats or (1 if args.quick else 3)
    started, load_start = time.perf_counter(), load_average()
    rows = []
    for model_name in models:
        runs: dict[str, list[dict[str, Any]]] = {c: [] for c in args.configs}
        for _ in range(repeats):  # interleaved: machine noise hits every configuration alike
            for config in args.configs:
                runs[config].append(_run_child(model_name, config))
                last = runs[config][-1]
                shown = "error" if "error" in last else f"{last['first_step_s']:.1f} s"
                print(f"{model_name:>10} {config:<24} {shown}", flush=True)
        rows += [_median_record(runs[c]) for c in args.configs]
    report = {
        "benchmark": "first_step",
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "software": software_info(ROOT),
        "threads": int(os.environ.get("FIRST_STEP_THREADS", "2")),
        "repeats": repeats,
        "load_average": {"start": load_start, "end": load_average()},
        "total_runtime_s": round(time.perf_counter() - started, 1),
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / ("first_step" + ("_quick" if args.quick else ""))
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    md = (
        f"# First training step ({report['date_utc']})\n\n"
        f"CPU ({report['machine'].get('cpu_model', report['machine']['processor'])}), torch "
        f"{torch.__version__}, {report['threads']} threads; each point is a fresh process with "
        f"a fresh Inductor cache directory, median of {repeats}; load average {load_start} at "
        f"start, {report['load_average']['end']} at end. Phases in seconds: see the script's "
        "docstring (capture etc. is the step less the named phases: Dynamo, AOTAutograd's "
        "tracing, running). Ratios: each configuration against the same executor's "
        '"none" and against its torch.compile peer (aot_eager for the eager executor, '
        "Inductor for the Inductor one).\n\n" + _table(rows) + "\n"
    )
    stem.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
