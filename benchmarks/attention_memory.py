"""Memory and time of one attention training step: naive, PyTorch SDPA, and memfit.nn.attention.

Issue 9's measurement: at sequence lengths 512 ... 8192 (B=1, H=8, D=64, fp32), with and without
a causal mask and dropout, the peak memory of forward + backward of one attention call above the
inputs (exact CPU allocation accounting, ``memfit.measure``), and its time (median of interleaved
repeats: ``--repeats`` above L=2048, three times as many up to it, where steps are short), each
method measured by the shared runner (``memfit.bench.runner``: one warm-up step, the peak, then
interleaved timing). Methods:

* ``naive``: ``softmax(q k^T * scale + mask)``, ``F.dropout``, ``@ v`` as models write it;
* ``sdpa``: ``F.scaled_dot_product_attention`` with the same arguments (on CPU its flash kernel
  has no dropout, so with dropout it silently takes the math path);
* ``memfit``: ``memfit.nn.attention`` (SDPA's fused kernel where it applies, memfit's chunked
  kernel otherwise, dropout masks as ``F.dropout`` draws them).

Runs whose quadratic tensors alone would exceed ``--max-gib`` are skipped and recorded as such.
Writes ``benchmarks/results/attention_memory.{json,md,png}`` (``--out`` elsewhere). ``--quick``:
L = 512, 1024, one repeat, into ``attention_memory_quick.*``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from memfit.bench.environment import load_average, machine_info, software_info
from memfit.bench.runner import Method, measure_peak, time_interleaved
from memfit.nn.attention import attention

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
B, H, D = 1, 8, 64
CASES = {
    "no mask": dict(causal=False, dropout=0.0),
    "causal": dict(causal=True, dropout=0.0),
    "dropout 0.1": dict(causal=False, dropout=0.1),
    "causal + dropout 0.1": dict(causal=True, dropout=0.1),
}

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def naive(causal: bool, dropout: float) -> Attention:
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        if causal:
            lq, lk = scores.shape[-2:]
            future = torch.ones(lq, lk, dtype=torch.bool).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        probs = F.dropout(scores.softmax(dim=-1), dropout, training=True)
        return probs @ v

    return run


def sdpa(causal: bool, dropout: float) -> Attention:
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=causal)

    return run


def memfit_attention(causal: bool, dropout: float) -> Attention:
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention(q, k, v, dropout_p=dropout, is_causal=causal)

    return run


METHODS = {"naive": naive, "sdpa": sdpa, "memfit": memfit_attention}


def _quadratic_gib(length: int) -> float:
    return B * H * length * length * 4 / 2**30


def _inputs(length: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(length)
    return tuple(torch.randn(B, H, length, D, generator=g).requires_grad_() for _ in range(3))


def _step(fn: Attention, inputs: tuple[torch.Tensor, ...], grad: torch.Tensor) -> None:
    for t in inputs:
        t.grad = None
    fn(*inputs).backward(grad)


def measure(
    length: int, case: dict[str, Any], repeats: int, max_gib: float
) -> list[dict[str, Any]]:
    inputs = _inputs(length)
    grad = torch.randn(B, H, length, D, generator=torch.Generator().manual_seed(1))
    rows: list[dict[str, Any]] = []
    methods: list[Method] = []
    for name, make in METHODS.items():
        fn = make(**case)
        # naive keeps about four L x L tensors (scores, probabilities, mask, dropout output)
        quadratic = name == "naive" or (name == "sdpa" and case["dropout"] > 0)
        if quadratic and 4 * _quadratic_gib(length) > max_gib:
            rows.append(
                {"method": name, "skipped": f"needs about {4 * _quadratic_gib(length):.0f} GiB"}
            )
            continue
        # no parameters: the step resets its inputs' gradients itself
        method = Method(name, torch.nn.Module(), partial(_step, fn, inputs, grad))
        method.run_step()  # warm-up (and lazy initialisation) outside the measurement
        measure_peak(method)
        rows.append({"method": name, "peak_bytes": method.record["peak_bytes"]})
        methods.append(method)
    time_interleaved(methods, rounds=repeats)
    seconds = {m.name: statistics.median(m.times) for m in methods}
    for row in rows:
        if row["method"] in seconds:
            row["seconds"] = seconds[row["method"]]
    return rows


def _table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| case | L | naive | sdpa | memfit | naive / memfit "
        "| time memfit / naive | time memfit / sdpa |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def mib(row: dict[str, Any] | None) -> str:
        if row is None or "peak_bytes" not in row:
            return "skipped" if row else ""
        return f"{row['peak_bytes'] / 2**20:,.1f} MiB"

    for res in results:
        by = {r["method"]: r for r in res["rows"]}
        n, s, mf = by.get("naive"), by.get("sdpa"), by.get("memfit")
        ratio = time_n = time_s = ""
        if n and mf and "peak_bytes" in n and "peak_bytes" in mf:
            ratio = f"{n['peak_bytes'] / max(mf['peak_bytes'], 1):.0f}x"
            time_n = f"{mf['seconds'] / n['seconds']:.2f}"
        if s and mf and "seconds" in s and "seconds" in mf:
            time_s = f"{mf['seconds'] / s['seconds']:.2f}"
        lines.append(
            f"| {res['case']} | {res['length']} | {mib(n)} | {mib(s)} | {mib(mf)} | {ratio} "
            f"| {time_n} | {time_s} |"
        )
    return "\n".join(lines)


def _figure(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CASES), figsize=(4 * len(CASES), 3.6), sharey=True)
    for ax, case in zip(axes, CASES, strict=True):
        for method in METHODS:
            pts = [
                (res["length"], row["peak_bytes"] / 2**20)
                for res in results
                if res["case"] == case
                for row in res["rows"]
                if row["method"] == method and "peak_bytes" in row
            ]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(case)
        ax.set_xlabel("sequence length")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("step peak above inputs (MiB)")
    axes[0].legend()
    fig.suptitle(f"One attention training step, B={B} H={H} D={D} fp32, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="L = 512, 1024; one repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-gib", type=float, default=6.0, help="skip quadratic runs above this")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    lengths = [512, 1024] if args.quick else [512, 1024, 2048, 4096, 8192]
    repeats = 1 if args.quick else args.repeats
    results = []
    for length in lengths:
        for case_name, case in CASES.items():
            # short steps are noisy on a shared machine: more repeats where they are cheap
            rows = measure(length, case, repeats if length > 2048 else 3 * repeats, args.max_gib)
            results.append({"case": case_name, "length": length, "rows": rows})
            print(case_name, length, rows, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": "attention_memory",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "software": software_info(ROOT),
        "load_average": load_average(),
        "shape": {"batch": B, "heads": H, "head_dim": D, "dtype": "float32"},
        "quick": args.quick,
        "results": results,
    }
    stem = args.out / ("attention_memory_quick" if args.quick else "attention_memory")
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1))
    stem.with_suffix(".md").write_text(_table(results) + "\n")
    _figure(results, stem.with_suffix(".png"))
    print(_table(results))


if __name__ == "__main__":
    main()
