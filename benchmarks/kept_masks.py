"""Kept masks: what a boolean mask kept for backward costs a step compiled by Inductor on CPU.

Why: torch's min-cut partitioner, asked what a step need not keep, prefers a ReLU's mask
(``x <= 0``, one byte per element) to the float32 output it tests (four), and memfit's cost model
called the swap free: nothing is recomputed. On CPU, measured in the budget frontier, the plans
that kept masks were the slow ones (a U-Net's budgets at 0.80-0.84 of eager's time where memfit
``"none"`` ran at 0.68). Since then memfit's candidates on CPU keep no mask
(``memfit.planning.fusion.slow_masks``); this script measures the rule by switching it off.

Models: the budget frontier's U-Net and transformer, where torch's min-cut keeps masks (the
ResNet's plans keep none). Points, per model: memfit with ``executor="inductor"`` at ``"none"``
and at budgets 1.0, 0.6 and 0.4, each with the rule (``rule on``) and without it (``rule off``:
``slow_masks`` patched to ban nothing while the point is planned), and ``torch.compile`` at
``activation_memory_budget`` 1.0 (which keeps masks) and 0.9. Per memfit point the mask
elements its plan keeps are counted. Measured as the budget frontier measures
(``memfit.bench.runner``: first step, exact peak, interleaved medians).

Run: ``python benchmarks/kept_masks.py`` (about 5 minutes on 2 cores); writes
``benchmarks/results/kept_masks/kept_masks.{json,md}`` (``--out-dir`` elsewhere). ``--settle``
and ``--steps-per-turn`` time each point in turns, as the budget frontier now does
(``memfit.bench.runner``); the default, one timed step per turn, is how the rule was first
measured.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import datetime as dt  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import budget_frontier as bf  # noqa: E402
import memfit.planning.fusion as fusion  # noqa: E402
from memfit.analysis.graph import node_tensors  # noqa: E402
from memfit.bench.environment import load_average, machine_info, software_info  # noqa: E402
from memfit.bench.runner import measure_peaks, time_interleaved  # noqa: E402
from memfit.units import MIB  # noqa: E402

OUT = bf.RESULTS / "kept_masks"
SETTINGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("mode none", {"mode": "none"}),
    ("budget 1", {"budget": 1.0}),
    ("budget 0.6", {"budget": 0.6}),
    ("budget 0.4", {"budget": 0.4}),
)


class _Rule:
    """``slow_masks`` as memfit has it, or (``on = False``) banning nothing; records the mask
    elements of every graph it is asked about, by node name."""

    def __init__(self) -> None:
        self.on = True
        self.elements: dict[str, int] = {}
        self._slow_masks = fusion.slow_masks

    def __call__(self, jg: Any) -> set[Any]:
        masks = self._slow_masks(jg)
        for n in masks:
            self.elements[n.name] = sum(t.numel() for t in node_tensors(n))
        return masks if self.on else set()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["unet", "transformer"])
    parser.add_argument("--rounds", type=int, default=15)
    bf.add_turn_arguments(parser, settle=0, steps=1)
    parser.add_argument("--out-dir", type=Path, default=OUT)
    args = parser.parse_args(argv)
    rule = _Rule()
    fusion.slow_masks = rule  # type: ignore[assignment]
    results = []
    for spec in (s for s in bf.model_specs(False) if s.name in args.models):
        torch.compiler.reset()
        points = [bf.Point(spec, "eager", "plain", {})]
        for b in (1.0, 0.9):
            points.append(
                bf.Point(spec, "torch.compile", f"budget {b:g}", {"activation_memory_budget": b})
            )
        for on in (True, False):
            for setting, params in SETTINGS:
                tag = f"{setting} rule {'on' if on else 'off'}"
                points.append(bf.Point(spec, "memfit", tag, {**params, "executor": "inductor"}))
                points[-1].record["rule"] = on
        for p in points:
            rule.on = p.record.get("rule", True)
            rule.elements.clear()
            bf.warm_up(p)
            if p.peer == "memfit" and p.ok():
                kept = {name for g in p.module.memfit.plan.graphs for name in g.kept}
                p.record["kept_mask_elements"] = sum(
                    e for name, e in rule.elements.items() if name in kept
                )
            print(f"  {spec.name} {p.name}: {p.status}", flush=True)
        rule.on = True
        measure_peaks(points, bf.CPU)
        time_interleaved(points, args.rounds, bf.CPU, settle=args.settle, steps=args.steps_per_turn)
        rows = []
        for p in points:
            rec = p.record
            if rec.get("times_s"):
                rec["time_s"] = statistics.median(rec["times_s"])
            rec["status"] = p.status
            rows.append(rec)
        results.append({"name": spec.name, "description": spec.description, "points": rows})
    report = {
        "benchmark": "kept_masks",
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "software": software_info(bf.ROOT),
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "settle": args.settle,
        "steps_per_turn": args.steps_per_turn,
        "load_average_end": load_average(),
        "models": results,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "kept_masks.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (args.out_dir / "kept_masks.md").write_text(_markdown(report))
    print(_markdown(report))
    return 0


def _markdown(report: dict[str, Any]) -> str:
    cpu = report["machine"].get("cpu_model", report["machine"].get("processor"))
    settle, steps = report.get("settle", 0), report.get("steps_per_turn", 1)
    timing = f"median of {report['rounds'] * steps} steps interleaved over all points of a model"
    if settle or steps > 1:
        timing += f", in turns of {settle} untimed step(s) then {steps} timed"
    lines = [
        f"# Kept masks ({report['date_utc']})",
        "",
        f"CPU ({cpu}), torch {report['software'].get('torch')}, {report['threads']} threads; "
        f"peak: exact allocator accounting of one step; time: {timing}. `rule off`: memfit's "
        "candidates may keep boolean masks, as torch's min-cut does; `rule on`: they may not "
        "(memfit's behaviour).",
    ]
    for res in report["models"]:
        eager = next(r for r in res["points"] if r["peer"] == "eager")
        lines += [
            "",
            f"## {res['name']}",
            "",
            res["description"],
            "",
            "| peer | setting | peak MiB | step ms | time / eager | kept mask elements |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for r in res["points"]:
            if r["status"] != "ok":
                lines.append(f"| {r['peer']} | {r['setting']} | {r['status']} | | | |")
                continue
            masks = r.get("kept_mask_elements")
            lines.append(
                f"| {r['peer']} | {r['setting']} | {r['peak_bytes'] / MIB:.1f} | "
                f"{r['time_s'] * 1e3:.0f} | {r['time_s'] / eager['time_s']:.2f} | "
                f"{'-' if masks is None else f'{masks / 1e6:.2f} M'} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
