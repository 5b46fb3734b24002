"""memfit's per-step time over plain PyTorch on tiny HuggingFace models, beside an A/A pair.

Why: on models this small a step is almost all per-call cost (on a GPU, launch time), so what
``"none"`` adds over plain is memfit's own overhead, and what ``"memory"`` adds beyond it should
be its recomputation. ELECTRA's ``"memory"`` steps once took 16.7x plain's and GPT-NeoX's 8.5x.
The HF sweep records step times too, but one architecture per process under whatever load the
machine has; here each model's ways run in one process, interleaved (``memfit.bench.runner``),
with two copies of plain (``plain`` and ``plain A/A``) whose difference is the noise floor the
other differences are read against.

Writes ``benchmarks/results/hf_step_overhead.{json,md}``.
Run: ``python benchmarks/hf_step_overhead.py [--models electra gpt_neox ...] [--rounds 15]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

import memfit
from memfit.bench import hf_tiny
from memfit.bench.environment import load_average, machine_info, software_info
from memfit.bench.runner import Method, first_step, time_interleaved

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MODELS = ("electra", "gpt_neox", "llama", "bert", "gpt2")
WAYS = ("plain", "plain A/A", "none", "memory")


def _method(name: str, way: str, batch: int, length: int) -> Method:
    model = hf_tiny.build(name)
    inputs = hf_tiny.make_inputs(name, model, batch, length)
    module = memfit.checkpoint(model, way) if way in ("none", "memory") else model

    def step() -> None:
        torch.manual_seed(0)
        module(**inputs).loss.backward()

    return Method(way, model, step, module=module)


def measure_model(name: str, rounds: int, batch: int, length: int) -> dict[str, Any]:
    """Median step time of each way, interleaved in this process, with what each adds."""
    methods = [_method(name, way, batch, length) for way in WAYS]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for m in methods:
            first_step(m)
        time_interleaved(methods, rounds, settle=1)
    ms = {m.name: 1e3 * statistics.median(m.record["times_s"]) for m in methods if not m.failed}
    plain = ms["plain"]
    return {
        "step_ms": {k: round(v, 3) for k, v in ms.items()},
        "a_a_ms": round(abs(ms["plain A/A"] - plain), 3),
        "none_over_plain_ms": round(ms["none"] - plain, 3),
        "memory_over_none_ms": round(ms["memory"] - ms["none"], 3),
        "none_ratio": round(ms["none"] / plain, 3),
        "memory_ratio": round(ms["memory"] / plain, 3),
        "faults": {m.name: m.record["faults"] for m in methods if m.record["faults"]},
    }


def markdown(result: dict[str, Any]) -> str:
    meta = result["meta"]
    lines = [
        "# memfit's per-step time over plain PyTorch, tiny HF models (CPU)",
        "",
        f"{meta['date']}, {meta['machine'].get('cpu_model', '')}, "
        f"torch {meta['software']['torch']}, "
        f"{meta['threads']} threads, batch {meta['shape']}, median of {meta['rounds']} "
        f"interleaved rounds; load {meta['load_start']} at start, {meta['load_end']} at end. "
        "A/A: the two copies of plain, the noise floor of this run.",
        "",
        "| model | plain ms | A/A ms | none ms | memory ms | none - plain | memory - none "
        "| none / plain | memory / plain |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in result["models"].items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error']} |||||||")
            continue
        s = r["step_ms"]
        lines.append(
            f"| {name} | {s['plain']:.2f} | {r['a_a_ms']:.2f} | {s['none']:.2f} | "
            f"{s['memory']:.2f} | {r['none_over_plain_ms']:+.2f} | "
            f"{r['memory_over_none_ms']:+.2f} | {r['none_ratio']:.2f} | {r['memory_ratio']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    unknown = sorted(set(args.models) - set(hf_tiny.ARCHITECTURES))
    if unknown:
        parser.error(f"unknown architectures {unknown}; see memfit.bench.hf_tiny.ARCHITECTURES")
    result: dict[str, Any] = {
        "meta": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine_info(),
            "software": software_info(ROOT),
            "threads": torch.get_num_threads(),
            "shape": f"{args.batch} x {args.length}",
            "rounds": args.rounds,
            "load_start": load_average(),
        },
        "models": {},
    }
    for name in args.models:
        try:
            result["models"][name] = measure_model(name, args.rounds, args.batch, args.length)
        except Exception as err:  # noqa: BLE001 - the table says which model failed and why
            result["models"][name] = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
        print(name, json.dumps(result["models"][name]), file=sys.stderr, flush=True)
    result["meta"]["load_end"] = load_average()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hf_step_overhead.json").write_text(json.dumps(result, indent=2))
    text = markdown(result)
    (out / "hf_step_overhead.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
