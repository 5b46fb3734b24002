"""How long ``memfit.plan`` takes, and how much host memory, on a 7B Llama it never allocates.

Issue 67's items 1 and 5: a Llama-shaped HF config (hidden 4096, 32 layers, 32 heads,
intermediate 11008, vocabulary 32000; bf16) built under ``torch.device("meta")`` and planned on
fake tensors for ``device="cuda"`` at batch 1, sequence 4096, under ``"none"``, ``"memory"`` and a
byte budget halfway between their predicted peaks. Each policy runs in a fresh Python process,
so its wall time includes Dynamo's capture from cold and its peak RSS (``ru_maxrss``) is its own;
import time is reported apart. Goal: under a minute for every policy, under 4 GiB of host memory.

Writes ``benchmarks/results/meta_planning.{json,md}`` (``--quick``: 2 layers, sequence 512, into
``meta_planning_quick.*``). Run with the Python of memfit's environment:
``python benchmarks/meta_planning.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

#: The 7B Llama shape the issue names.
LLAMA_7B = dict(
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    intermediate_size=11008,
    vocab_size=32000,
    max_position_embeddings=4096,
)


def meta_llama(layers: int, seq: int) -> tuple[Any, Any]:
    """The 7B Llama shape with ``layers`` layers, in bf16 on the meta device, and meta token ids
    of one sequence of ``seq``: nothing allocated."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        **{**LLAMA_7B, "num_hidden_layers": layers}, attn_implementation="sdpa"
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).train()
    return model, torch.zeros(1, seq, dtype=torch.long, device="meta")


def plan_once(policy: str, layers: int, seq: int, budget: int | None) -> dict[str, Any]:
    """One plan in this process: build on meta, plan for CUDA, time and peak RSS."""
    started = time.perf_counter()
    import transformers  # noqa: F401  (timed here as part of the import, not of the build)

    import memfit

    imported = time.perf_counter()
    model, ids = meta_llama(layers, seq)
    built = time.perf_counter()
    chosen: Any = budget if policy == "budget" else policy
    plan = memfit.plan(model, input_ids=ids, labels=ids, policy=chosen, device="cuda")
    planned = time.perf_counter()
    assert all(p.is_meta for p in model.parameters())  # nothing was allocated for the model
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "policy": policy,
        "budget_bytes": budget,
        "parameters": sum(p.numel() for p in model.parameters()),
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "kept_bytes": plan.kept_bytes,
        "recompute_flops": plan.recompute_flops,
        "graphs": len(plan.graphs),
        "import_s": round(imported - started, 2),
        "build_s": round(built - imported, 2),
        "plan_s": round(planned - built, 2),
        # CPU time of the whole process (import included): what the plan costs on a machine
        # others load, where wall time depends on them
        "process_cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
        "peak_rss_bytes": usage.ru_maxrss * 1024,
    }


def search_once(device: str, layers: int, seq: int) -> dict[str, Any]:
    """``memfit.fit``'s largest-batch search under ``"memory"`` for ``device``, in this process:
    how many plans it made and how long it took (issue 67 item 5: a search's cost must not grow
    with the batch it finds)."""
    import memfit

    model, ids = meta_llama(layers, seq)
    built = time.perf_counter()
    rep = memfit.fit(model, device=device, policies=["memory"], input_ids=ids, labels=ids)
    row = rep.rows[0]
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "device": device,
        "largest_batch": row.largest_batch,
        "exact": row.exact,
        "plans": row.plans,
        "search_s": round(time.perf_counter() - built, 1),
        "process_cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
        "peak_rss_bytes": usage.ru_maxrss * 1024,
    }


def run_search(device: str, layers: int, seq: int) -> dict[str, Any]:
    """``search_once`` in a fresh process."""
    args = [sys.executable, __file__, "--search-one", device, "--layers", str(layers)]
    proc = subprocess.run([*args, "--seq", str(seq)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return {"device": device, "error": " | ".join(proc.stderr.strip().splitlines()[-3:])}
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def run_policy(policy: str, layers: int, seq: int, budget: int | None) -> dict[str, Any]:
    """``plan_once`` in a fresh process (its own Dynamo caches and peak RSS)."""
    args = [sys.executable, __file__, "--one", policy, "--layers", str(layers), "--seq", str(seq)]
    if budget is not None:
        args += ["--budget", str(budget)]
    proc = subprocess.run(args, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        return {"policy": policy, "error": tail}
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _table(rows: list[dict[str, Any]]) -> str:
    from memfit.units import format_bytes

    lines = [
        "| policy | predicted peak (cuda) | plan wall time | import | process CPU time "
        "| peak host RSS |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['policy']} | error: {r['error']} | | | | |")
            continue
        lines.append(
            f"| {r['policy']} | {format_bytes(r['predicted_peak_bytes'])} | "
            f"{r['plan_s']:.1f} s | {r['import_s']:.1f} s | {r['process_cpu_s']:.0f} s | "
            f"{format_bytes(r['peak_rss_bytes'])} |"
        )
    return "\n".join(lines)


def _search_table(rows: list[dict[str, Any]]) -> str:
    from memfit.units import format_bytes

    lines = [
        "| device | largest batch | plans | search wall time | process CPU time | peak host RSS |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['device']} | error: {r['error']} | | | | |")
            continue
        lines.append(
            f"| {r['device']} | {r['largest_batch']}{'' if r['exact'] else ' ~'} | {r['plans']} | "
            f"{r['search_s']:.1f} s | {r['process_cpu_s']:.0f} s | "
            f"{format_bytes(r['peak_rss_bytes'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 layers at sequence 512")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--search-one", help=argparse.SUPPRESS)
    parser.add_argument(
        "--searches",
        default="h100-80gb,h200",
        help="devices to time memfit.fit's largest-batch search for ('' for none)",
    )
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--budget", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    layers = args.layers or (2 if args.quick else LLAMA_7B["num_hidden_layers"])
    seq = args.seq or (512 if args.quick else 4096)
    if args.one:
        print(json.dumps(plan_once(args.one, layers, seq, args.budget)))
        return
    if args.search_one:
        print(json.dumps(search_once(args.search_one, layers, seq)))
        return

    from memfit.bench.environment import load_average, report

    started, load_start = time.perf_counter(), load_average()
    rows = [run_policy(p, layers, seq, None) for p in ("none", "memory")]
    peaks = [r.get("predicted_peak_bytes") for r in rows]
    if all(isinstance(p, int) for p in peaks):
        budget = (peaks[0] + peaks[1]) // 2
        rows.append(run_policy("budget", layers, seq, budget))
    searches = [run_search(d, layers, seq) for d in args.searches.split(",") if d]
    name = "meta_planning_quick" if args.quick else "meta_planning"
    out = args.out or RESULTS / name
    record = report(
        "meta_planning",
        ROOT,
        started,
        load_start,
        rows,
        config={**LLAMA_7B, "num_hidden_layers": layers},
        batch=1,
        sequence=seq,
        dtype="bfloat16",
        device="cuda (planned on fake tensors; no GPU here)",
        note="2-core machine; see load_average for what else ran",
        searches=searches,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    table = _table(rows)
    out.with_suffix(".md").write_text(
        f"# memfit.plan on a meta Llama ({layers} layers, seq {seq}, bf16) for CUDA\n\n"
        f"{record['date_utc']}, torch {record['software']['torch']}, "
        f"{record['machine'].get('cpu_model', '')}, load {record['load_average']}\n\n"
        f"{table}\n\n"
        'memfit.fit\'s largest-batch search under `"memory"` (AdamW foreach, bf16), each in a '
        "fresh process:\n\n"
        f"{_search_table(searches)}\n"
    )
    print(table)


if __name__ == "__main__":
    main()
