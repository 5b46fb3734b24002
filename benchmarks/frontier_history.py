"""Every Inductor budget frontier run kept in the tree, summarised the same way.

Why: the frontier's runs differ in machine (the CPU, each lent GPU) and in the code they ran, and
each printed its comparison with the rules of its day. This script reads every
``budget_frontier_inductor*.json`` under ``benchmarks/results/`` (the latest CPU run, and the
latest GPU run of each model under ``gpu_h100/`` and ``gpu_h200/``) and recomputes, with the
benchmark's own ``equal_peak_comparison``, per run and model (a GPU run's row names the GPU: the
runs on lent GPUs were short, 16 steps per point, and their intervals say how little that
resolves): how many memfit points have a ``torch.compile`` point at <= 1.05x their measured
peak, and the median and worst memfit / ``torch.compile`` ratio four ways: setting by setting
(medians), on each point's fastest step, with the settings that ran one program pooled
(``budget_frontier._pooled_medians``; a run that recorded no programs pools nothing), and those
programs compared turn by turn (``budget_frontier._paired``: step k against step k, so that the
machine's drift between turns divides out). Older runs are in git history; a folder of them
passed as ``--results`` is summarised alike, oldest first.

Writes ``frontier_history.md`` in ``--results`` (``--out`` elsewhere; ``--quick`` writes
``frontier_history_quick.md``, the same summary: reading JSON takes a second or two either way).
Run: ``python benchmarks/frontier_history.py``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from budget_frontier import (
    RESULTS,
    equal_peak_comparison,
    ratio_summary,
    same_program_pairs,
    same_program_summary,
)

PEER = "torch.compile"


def runs(root: Path) -> list[tuple[str, dict[str, Any]]]:
    """Every Inductor frontier run under ``root`` (not the quick ones), oldest first, as (its
    JSON file's path under ``root`` without the suffix, the run)."""
    found = []
    for path in root.rglob("budget_frontier_inductor*.json"):
        if path.stem.endswith("_quick"):
            continue
        run = json.loads(path.read_text())
        found.append((str(path.relative_to(root).with_suffix("")), run))
    return sorted(found, key=lambda item: item[1]["date_utc"])


def _machine(run: dict[str, Any]) -> str:
    """The GPU a run timed on, or CPU."""
    if str(run["parameters"].get("device", "cpu")).startswith("cuda"):
        return str(run.get("machine", {}).get("gpu", "GPU"))
    return "CPU"


def table(root: Path) -> str:
    lines = [
        "| run (folder) | date (UTC) | machine | model | timed steps per point | "
        "memfit points compared "
        "| medians: median, worst | fastest steps: median, worst | one program pooled: median, "
        "worst | pooled, turn by turn: median, worst | turn by turn, slower beyond noise "
        "| A/A: pairs, widest, beyond noise |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for stem, run in runs(root):
        for model in run["models"]:
            # before turns, each round timed one step per point: a turn of one
            steps_per_turn = run["parameters"].get("steps_per_turn", 1)
            s = ratio_summary(equal_peak_comparison(model["points"], steps_per_turn), PEER)
            if s is None:
                continue
            cells = [
                f"{s[k][0]:.2f}, {s[k][1]:.2f}" for k in ("medians", "fastest", "pooled", "paired")
            ]
            aa = same_program_summary(same_program_pairs(model["points"], steps_per_turn))
            aa_cell = (
                "-" if aa is None else f"{aa['pairs']}, {aa['widest']:.2f}, {aa['beyond_noise']}"
            )
            folder = str(Path(stem).parent)
            link = f"[{stem if folder == '.' else folder}]({stem}.md)"
            lines.append(
                f"| {link} | {run['date_utc'][:16]} | {_machine(run)} | {model['name']} | "
                f"{_timed(run['parameters'])} | {s['compared']} | " + " | ".join(cells) + " | "
                f"{s['paired_beyond_noise']} | {aa_cell} |"
            )
    return "\n".join(lines)


def _timed(parameters: dict[str, Any]) -> str:
    """Timed steps per point; with turns (runs from 2026-11-25 on), how they ran."""
    steps = parameters.get("steps_per_turn")
    if steps is None:
        return str(parameters["rounds"])
    return (
        f"{parameters['rounds'] * steps} ({parameters['rounds']} turns of "
        f"{parameters['settle']} untimed + {steps})"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=RESULTS, help="the runs' folder")
    p.add_argument("--out", type=Path, help="where the summary goes (default: --results)")
    p.add_argument("--quick", action="store_true", help="write frontier_history_quick.md")
    args = p.parse_args(argv)
    text = (
        "# Inductor budget frontier: every run kept\n\n"
        'memfit (`executor="inductor"`) against the fastest `torch.compile('
        "activation_memory_budget=b)` point at <= 1.05x memfit's measured peak, recomputed from "
        "each run's JSON by `benchmarks/frontier_history.py` with today's comparison. A ratio "
        "above 1 means memfit was slower. Runs differ in the machine and the code they ran "
        "(each run's JSON records its commit, `software.git_commit`); older runs are in git "
        'history. "Turn by turn" '
        "compares the pooled programs step k against step k (the k-th steps of all of a run's "
        "points ran in one turn, or one round before turns), the median of those ratios: what "
        'the machine\'s speed drifts between turns divides out. "Slower beyond noise" counts the '
        "memfit points whose turn-by-turn ratio has a 95% interval (a bootstrap over turns) "
        'wholly above 1. "A/A" compares, the same way, every two settings of one peer that '
        "compiled one program (`budget_frontier.same_program_pairs`): how many pairs, the "
        "widest pair's ratio (as max(r, 1/r)), and how many had an interval excluding 1. Where "
        "nothing differs, that is what the run reads as a difference; single settings are "
        "noisier than the pooled programs compared with torch.compile, so their spread is, if "
        "anything, wider than that comparison's noise. GPU rows name the GPU: those runs, on a "
        "lent device's few minutes, timed 16-20 steps per point of 7-14 ms.\n\n"
        + table(args.results)
        + "\n"
    )
    out_dir = args.out or args.results
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / ("frontier_history_quick.md" if args.quick else "frontier_history.md")
    out.write_text(text)
    print(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
