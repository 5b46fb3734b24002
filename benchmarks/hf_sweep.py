"""Every architecture transformers ships that builds from a tiny config, trained with memfit.

For each architecture of ``memfit.bench.hf_tiny.ARCHITECTURES`` (decoders, MoE, state-space,
encoders, seq2seq, vision, audio, multimodal), each in its own process
(``memfit.bench.hf_sweep.run_isolated``, a timeout per model): plain PyTorch, HF's
``gradient_checkpointing_enable()``, memfit ``"memory"`` and ``"none"``, one ``Trainer``-style
fp32 CPU step at batch 2 x 64, measured exactly (``memfit.measure``), memfit's losses and
gradients against plain's, each memfit peak against its prediction, and median step times.
The four criteria (``hf_sweep.CRITERIA``) are checked per row; an architecture that fails to
build or that memfit cannot serve is in the table with its reason.

Writes ``benchmarks/results/hf_sweep.json`` and ``.md`` (machine, torch and transformers
versions, date; after every row, so a run cut short keeps what it measured). Run:
``.venv/bin/python benchmarks/hf_sweep.py [--only gpt2,llama] [--timeout 600] [--length 64]``;
``--resume`` keeps the rows already written (each names the date and commit it was measured at)
and measures the rest; ``--quick``: three architectures (GPT-2, BERT, ViT), into
``hf_sweep_quick.*``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from memfit.bench import hf_sweep, hf_tiny
from memfit.bench.environment import load_average, machine_info, software_info

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
KiB = 1024
QUICK = ("gpt2", "bert", "vit")


def interleaved(names: list[str]) -> list[str]:
    """``names`` taken one family at a time in turn, so a run cut short has every family."""
    by_family: dict[str, list[str]] = {}
    for name in names:
        by_family.setdefault(hf_tiny.ARCHITECTURES[name].family, []).append(name)
    queues = list(by_family.values())
    out: list[str] = []
    while any(queues):
        out += [q.pop(0) for q in queues if q]
    return out


def _ratio(a: int | None, b: int | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else ""


def _mark(value: bool | None) -> str:
    return {True: "yes", False: "**no**", None: "n/a"}[value]


def _reason(row: dict[str, Any]) -> str:
    """Why a row is not served, or misses a criterion: the first error or unsupported way."""
    if "build_error" in row:
        return f"does not build: {row['build_error']}"
    if "error" in row:
        return row["error"]
    reasons = []
    for method, rec in row.get("methods", {}).items():
        if "error" in rec:
            reasons.append(f"{method}: {rec['error']}")
        elif "unsupported" in rec:
            reasons.append(f"{method}: {rec['unsupported']}")
        for w in rec.get("warnings", []):
            reasons.append(f"{method} warned: {w}")
    return "; ".join(reasons)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:300]


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """How many rows built, were served (both memfit ways ran), and met each criterion."""
    built = [r for r in rows if "criteria" in r]
    out: dict[str, Any] = {"architectures": len(rows), "built": len(built)}
    out["served"] = sum(
        all("peak_bytes" in r["methods"][m] for m in ("memory", "none")) for r in built
    )
    for c in hf_sweep.CRITERIA:
        out[c] = sum(r["criteria"][c] is True for r in built)
    out["all_four"] = sum(all(r["criteria"][c] is True for c in hf_sweep.CRITERIA) for r in built)
    return out


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    s = meta["summary"]
    lines = [
        "# memfit on every tiny HuggingFace architecture (CPU, fp32)",
        "",
        f"{meta['date']}, {meta['machine'].get('cpu_model', '')}, torch "
        f"{meta['software'].get('torch')}, transformers {meta['software'].get('transformers')}, "
        f"memfit {meta['software'].get('git_commit', '')[:10]}; {meta['shape']}; "
        f"{meta['threads']} threads, load {meta.get('load_average')}. One process per "
        "architecture. Peaks: bytes above the step's start (exact allocator events), "
        "`.grad` None before each step, the output dropped before backward. Prediction: memfit's "
        f'predicted peak over the measured one, for `"memory"` / `"none"` (criterion: '
        f"-{hf_sweep.UNDER:.0%} to +{hf_sweep.OVER:.0%}). Exact: loss and gradients against "
        f"plain's (loss {hf_sweep.LOSS_RTOL:g} relative, gradients {hf_sweep.GRAD_RTOL:g} of "
        "the largest). Step: median of the timed steps.",
        "",
        f"**{s['architectures']} architectures, {s['built']} built, {s['served']} served by "
        f"memfit; exact {s['exact']}, prediction within bounds {s['prediction']}, "
        f'`"memory"` <= HF checkpointing {s["memory_le_hf_gc"]}, `"none"` <= plain '
        f"{s['none_le_plain']}; all four {s['all_four']}.**",
        "",
        "| architecture | family | params | plain (KiB) | HF GC | memory | none | pred. memory "
        "| pred. none | exact | pred. ok | mem <= GC | none <= plain | step plain / GC / memory "
        "/ none (ms) | first step memory (s) | reason |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|---:|---:|---|",
    ]
    for r in rows:
        m = r.get("methods", {})
        plain, gc, mem, none = (m.get(k, {}) for k in hf_sweep.METHODS)
        base = plain.get("peak_bytes")
        crit = r.get("criteria", {})
        steps = " / ".join(
            f"{x['step_s'] * 1e3:.0f}" if x.get("step_s") else "-" for x in (plain, gc, mem, none)
        )
        first = mem.get("first_step_s")
        lines.append(
            f"| {r['name']} | {r['family']} | {r.get('parameters', '')} | "
            f"{'' if base is None else f'{base / KiB:.0f}'} | "
            f"{_ratio(gc.get('peak_bytes'), base)} | {_ratio(mem.get('peak_bytes'), base)} | "
            f"{_ratio(none.get('peak_bytes'), base)} | "
            f"{_ratio(mem.get('predicted_bytes'), mem.get('peak_bytes'))} | "
            f"{_ratio(none.get('predicted_bytes'), none.get('peak_bytes'))} | "
            + " | ".join(_mark(crit.get(c)) for c in hf_sweep.CRITERIA)
            + f" | {steps} | {'' if first is None else f'{first:.1f}'} | {_cell(_reason(r))} |"
        )
    lines += [
        "",
        "HF GC, memory and none: peak over plain's. pred.: predicted over measured peak. "
        "mem <= GC compares with plain where the architecture has no gradient checkpointing.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--only", help="comma-separated architecture names")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per architecture")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--timed", type=int, default=3, help="timed steps per way (median)")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the rows already in the results file and measure only the others",
    )
    parser.add_argument(
        "--redo",
        default="",
        help="with --resume: comma-separated rows to measure again (the code changed under them)",
    )
    args = parser.parse_args()
    names = interleaved(
        args.only.split(",") if args.only else list(QUICK if args.quick else hf_tiny.ARCHITECTURES)
    )
    import transformers

    software = software_info(ROOT)
    software["transformers"] = transformers.__version__
    meta: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "machine": machine_info(),
        "software": software,
        "threads": torch.get_num_threads(),
        "shape": f"batch {args.batch} x {args.length}, fp32, CPU",
        "timeout_s": args.timeout,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "hf_sweep" + ("_quick" if args.quick else "")
    rows: list[dict[str, Any]] = []
    kept = out / f"{stem}.json"
    if args.resume and kept.exists():
        # A row measured by an earlier run is kept as it was, with the date and commit it names;
        # the header names this run's machine and date.
        redo = set(filter(None, args.redo.split(",")))
        rows = [
            r
            for r in json.loads(kept.read_text())["rows"]
            if r["name"] in names and r["name"] not in redo
        ]
        kept_names = {r["name"] for r in rows}
        # the rows asked again first, then those never measured
        names = [n for n in names if n in redo] + [
            n for n in names if n not in redo and n not in kept_names
        ]
    started = time.perf_counter()

    def write() -> str:
        meta["load_average"] = load_average()
        meta["summary"] = summary(rows)
        meta["total_s"] = round(time.perf_counter() - started, 1)
        (out / f"{stem}.json").write_text(
            json.dumps({"meta": meta, "rows": rows}, indent=2, default=float)
        )
        text = markdown(rows, meta)
        (out / f"{stem}.md").write_text(text)
        return text

    for name in names:
        row = hf_sweep.run_isolated(
            name,
            timeout=args.timeout,
            batch=args.batch,
            length=args.length,
            timed=args.timed,
            threads=torch.get_num_threads(),
        )
        row["measured"] = {"date": meta["date"], "commit": software.get("git_commit", "")[:10]}
        rows.append(row)
        short = {k: row.get(k) for k in ("name", "criteria", "wall_s", "cpu_s", "error")}
        print(json.dumps(short, default=float), file=sys.stderr, flush=True)
        write()
    print(json.dumps(summary(rows)))


if __name__ == "__main__":
    main()
