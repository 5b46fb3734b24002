"""How long the budget planner takes on graphs of 1,000 to 10,000+ nodes, on one core.

Issue 4's target: ≤ 1 s for a 1,000-node joint graph and ≤ 10 s for a 10,000-node one. Graphs
are real AOTAutograd joint graphs: generated residual MLPs with random long skips (every block
adds the output of a randomly chosen earlier block, so the graph is not a chain) at several
depths, and a deep, narrow GPT-2 (HuggingFace ``GPT2LMHeadModel`` from a config). Timed, per
graph, median of ``--repeats``:

* ``frontier_s``: the whole budget planner: ``pareto_frontier`` (plain, speed and memory plans,
  the segment programme at every grid budget, one simulation per distinct plan) and ``choose``;
* ``workspace_s``: measuring op scratch memory on real tensors (done once per graph when memfit
  captures a model; it runs each distinct op signature once, so it is reported separately).

Writes ``benchmarks/results/planning_time.{json,md}`` (``--out`` elsewhere; ``--quick``, the two
smallest graphs planned once, into ``planning_time_quick.*``). Run with the Python of the
environment memfit is installed in (``pip install -e .``; the Makefile's ``.venv``):
``python benchmarks/planning_time.py [--quick]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from memfit.analysis.graph import JointGraph  # noqa: E402
from memfit.analysis.op_scratch import measure_op_memory  # noqa: E402
from memfit.bench.graphs import joint_graphs  # noqa: E402
from memfit.planning.frontier import choose, pareto_frontier  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


class SkipMLP(nn.Module):
    """``depth`` blocks of Linear-LayerNorm-GELU; block i also adds block ``skip[i]``'s output."""

    def __init__(self, depth: int, width: int = 64, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU())
            for _ in range(depth)
        )
        self.skip = [int(torch.randint(0, max(i, 1), (1,), generator=gen)) for i in range(depth)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [x]
        for i, block in enumerate(self.blocks):
            outs.append(block(outs[-1]) + outs[self.skip[i]])
        return outs[-1].square().mean()


def _gpt2(layers: int) -> tuple[nn.Module, tuple[Any, ...]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=layers, n_embd=64, n_head=4, n_positions=64, vocab_size=256, use_cache=False
    )
    model = GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    return model, (ids,)


def capture(model: nn.Module, *args: Any) -> JointGraph:
    """The one joint graph AOTAutograd builds for ``model(*args)`` (no graph breaks here)."""
    graphs = joint_graphs(model, *args)
    if len(graphs) != 1:
        raise RuntimeError(f"expected one graph, got {len(graphs)}")
    return graphs[0]


def _median_time(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small graphs only, planned once")
    parser.add_argument("--repeats", type=int, help="planner runs per graph; default 3, quick 1")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    torch.set_num_threads(1)

    cases: list[tuple[str, Callable[[], tuple[nn.Module, tuple[Any, ...]]]]] = []
    depths = [10, 40] if args.quick else [10, 40, 160, 400]
    for depth in depths:
        cases.append((f"skip-mlp-{depth}", lambda d=depth: (SkipMLP(d), (torch.randn(256, 64),))))
    if not args.quick:
        for layers in (12, 60):
            cases.append((f"gpt2-{layers}-layers", lambda n=layers: _gpt2(n)))

    rows = []
    for name, build in cases:
        model, inputs = build()
        t = time.perf_counter()
        jg = capture(model, *inputs)
        capture_s = time.perf_counter() - t
        min_bytes = max(jg.storage_bytes.values()) // 64
        workspace_s, workspace = _median_time(
            lambda jg=jg, min_bytes=min_bytes: measure_op_memory(jg.nodes, min_bytes=min_bytes), 1
        )
        jg.op_scratch = workspace.scratch
        jg.hold_outputs(workspace.outputs)

        def plan(jg: JointGraph = jg) -> Any:
            points = pareto_frontier(jg)
            return points, choose(points, (points[0].peak_bytes + points[-1].peak_bytes) // 2)

        frontier_s, (points, _) = _median_time(plan, args.repeats)
        row = {
            "graph": name,
            "nodes": len(jg.nodes),
            "forward_nodes": len(jg.forward),
            "frontier_s": frontier_s,
            "workspace_s": workspace_s,
            "capture_s": capture_s,
            "frontier_points": len(points),
        }
        rows.append(row)
        print(
            f"{name:>20}: {row['nodes']:6d} nodes  planner {frontier_s:6.2f} s  "
            f"workspace {workspace_s:5.2f} s  ({len(points)} frontier points)",
            flush=True,
        )

    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": f"{platform.node()} ({platform.processor() or platform.machine()})",
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "quick": args.quick,
    }
    stem = args.out / ("planning_time_quick" if args.quick else "planning_time")
    stem.with_suffix(".json").write_text(json.dumps({**meta, "graphs": rows}, indent=2))
    lines = [
        f"Planning time, one core ({meta['machine']}, torch {meta['torch']}, {meta['date']})",
        "",
        "| graph | joint nodes | planner (s) | workspace measurement (s) | points |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {r['graph']} | {r['nodes']} | {r['frontier_s']:.2f} | {r['workspace_s']:.2f} "
        f"| {r['frontier_points']} |"
        for r in rows
    ]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
