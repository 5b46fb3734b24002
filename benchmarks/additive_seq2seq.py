"""Meng et al.'s seq2seq table on CPU: largest batch that fits, naive vs memfit additive attention.

Meng et al. (NIPS 2017, "Training Deeper Models by GPU Memory Optimization on TensorFlow",
Table 3) trained a seq2seq model with additive attention; the decoder attends over the ``T``
encoder states at each of its ``T`` steps, so autograd keeps a ``[B, T, H]`` tanh output per step,
``T² · B · H`` in all. Their fused op, which recomputes it in backward, raised the largest batch
that fits at ``T = 400`` from 2 to 60. This script does the same measurement with
``memfit.nn.additive_attention``:

* the model (:class:`Seq2Seq`): embeddings, a bidirectional GRU encoder, a GRU-cell decoder that
  at each step attends (additive attention, keys projected once per sequence, the usual Bahdanau
  "processed memory") over the encoder states, and a linear read-out; one training step is
  forward, cross-entropy, backward. The two variants share every parameter and differ only in
  the attention call: the formula written out in PyTorch, or ``additive_attention``.
* the budget: one fixed number of bytes for every ``T``, chosen so that naive attention gets
  batch 2 at the largest ``T`` (the midpoint of its measured peaks at batches 2 and 3), as in the
  paper; ``--budget-mib`` overrides it.
* the largest batch: the step's peak tensor memory is measured exactly (the shared runner's
  ``measure_peak``: ``memfit.measure``, the profiler's allocator events, not process RSS); a
  search over the batch (an affine prediction from the measured peaks, then bisection between a
  batch that fits and one that does not) finds the largest batch whose peak is within the budget.
* time: one step of each variant at a common batch (naive's largest at that ``T``), the median of
  ``--repeats`` interleaved runs, without the profiler (the runner's ``time_interleaved``).

Outputs, in ``benchmarks/results/`` (``--out`` elsewhere; ``_quick`` suffix for ``--quick``):
``additive_seq2seq.json`` (machine, versions, parameters, every probe), ``additive_seq2seq.md``
(the table) and ``additive_seq2seq.png``. Run: ``python benchmarks/additive_seq2seq.py
[--quick]``; ``--quick`` (T = 25, 50) takes under a minute, the full sweep (T = 50, 100, 200,
400) several minutes on 2 cores.
"""

from __future__ import annotations

import os

# Read by OpenMP when torch loads, so it must be set before the imports below: spinning worker
# threads on a shared 2-core machine make step times swing by 10x.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import datetime as dt  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

from memfit.bench.environment import load_average, machine_info, software_info  # noqa: E402
from memfit.bench.runner import Method, measure_peak, time_interleaved  # noqa: E402
from memfit.nn import AdditiveAttention, additive_attention  # noqa: E402
from memfit.units import MIB  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

LENGTHS = (50, 100, 200, 400)
QUICK_LENGTHS = (25, 50)
METHODS = ("naive", "memfit")
#: The batch naive attention gets at the largest length, as in Meng et al.'s Table 3.
NAIVE_TARGET_BATCH = 2
MAX_BATCH = 4096


class Seq2Seq(nn.Module):
    """Embedding, bidirectional GRU encoder, GRU-cell decoder with additive attention, read-out.

    ``attention`` is ``"naive"`` (the formula in plain PyTorch: autograd keeps the ``[B, T, H]``
    tanh output of every decoder step) or ``"memfit"`` (``memfit.nn.additive_attention``).
    """

    def __init__(self, vocab: int, emb: int, hidden: int, attn: int, attention: str) -> None:
        super().__init__()
        if attention not in METHODS:
            raise ValueError(f"attention must be one of {METHODS}, got {attention!r}")
        self.attention, self.hidden, self.vocab = attention, hidden, vocab
        self.src_emb = nn.Embedding(vocab, emb)
        self.tgt_emb = nn.Embedding(vocab, emb)
        self.encoder = nn.GRU(emb, hidden, batch_first=True, bidirectional=True)
        self.attn = AdditiveAttention(hidden, 2 * hidden, attn)
        self.cell = nn.GRUCell(emb + 2 * hidden, hidden)
        self.out = nn.Linear(3 * hidden, vocab)

    def attend(self, h: torch.Tensor, keys: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """Context ``[B, 2·hidden]`` for decoder state ``h`` over projected ``keys``."""
        w_query, v = self.attn.w_query, self.attn.v
        if self.attention == "memfit":
            return additive_attention(h, keys, states, w_query, None, v)
        scores = torch.tanh((h @ w_query.t())[:, None, :] + keys) @ v  # [B, T]
        return (torch.softmax(scores, dim=-1)[:, None, :] @ states)[:, 0]

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        states, _ = self.encoder(self.src_emb(src))  # [B, T, 2·hidden]
        keys = self.attn.project_keys(states)  # once per sequence
        y = self.tgt_emb(tgt_in)
        h = states.new_zeros(src.shape[0], self.hidden)
        logits = []
        for t in range(tgt_in.shape[1]):
            context = self.attend(h, keys, states)
            h = self.cell(torch.cat([y[:, t], context], dim=-1), h)
            logits.append(self.out(torch.cat([h, context], dim=-1)))
        return torch.stack(logits, dim=1)


def make_step(model: Seq2Seq, batch: int, length: int) -> Callable[[], float]:
    """One training step (forward, loss, backward) on random tokens; returns the loss."""
    g = torch.Generator().manual_seed(batch * 1000 + length)
    src = torch.randint(model.vocab, (batch, length), generator=g)
    tgt = torch.randint(model.vocab, (batch, length + 1), generator=g)

    def step() -> float:
        model.zero_grad(set_to_none=True)
        logits = model(src, tgt[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, model.vocab), tgt[:, 1:].reshape(-1))
        loss.backward()
        return float(loss.detach())

    return step


def step_peak(model: Seq2Seq, batch: int, length: int) -> int:
    """Exact peak tensor bytes of one step above what was live before it."""
    peak = measure_peak(Method(f"batch {batch}", model, make_step(model, batch, length))).peak_bytes
    assert peak is not None
    return peak


def largest_batch(
    model: Seq2Seq, length: int, budget: int, probes: dict[int, int]
) -> tuple[int, dict[int, int]]:
    """The largest batch whose step peak is at most ``budget``; ``probes``: batch -> peak bytes.

    Peaks grow with the batch (nearly affinely), so: measure batches 1 and 2, predict the answer
    from the line through the two largest probes, probe it and its successor, and bisect between
    the largest batch that fits and the smallest that does not until they are adjacent.
    """

    def fits(b: int) -> bool:
        if b not in probes:
            probes[b] = step_peak(model, b, length)
        return probes[b] <= budget

    def settle(b: int) -> None:  # probe b if it lies strictly inside (lo, hi); narrow the gap
        nonlocal lo, hi
        if lo < b and (hi is None or b < hi):
            if fits(b):
                lo = b
            else:
                hi = b

    if not fits(1):
        return 0, probes
    lo, hi = 1, None  # lo fits; hi, once known, does not
    settle(2)
    while hi is None or hi - lo > 1:
        fitting = sorted(b for b in probes if probes[b] <= budget)
        a, b = fitting[-2:] if len(fitting) > 1 else (0, fitting[0])
        slope = max((probes[b] - (probes[a] if a else 0)) / (b - a), 1.0)
        guess = max(b + int((budget - probes[b]) // slope), lo + 1)
        if hi is None and guess > MAX_BATCH:
            return MAX_BATCH, probes
        guess = guess if hi is None else min(guess, hi - 1)
        settle(guess)
        settle(guess + 1 if lo == guess else guess - 1)  # a correct guess is bracketed at once
        if hi is not None:
            settle((lo + hi) // 2)  # otherwise bisect, so the gap always halves
    return lo, probes


def median_step_times(
    models: dict[str, Seq2Seq], batch: int, length: int, repeats: int
) -> dict[str, float]:
    """Median seconds of one step per method, timed by the shared runner (interleaved rounds,
    the order rotating, profiler off) after one warm-up step each."""
    methods = [Method(n, m, make_step(m, batch, length)) for n, m in models.items()]
    for method in methods:
        method.run_step()
    time_interleaved(methods, repeats)
    return {method.name: statistics.median(method.times) for method in methods}


def agreement(models: dict[str, Seq2Seq]) -> dict[str, float]:
    """Loss and largest gradient relative error of memfit against naive on one small batch."""
    losses, grads = {}, {}
    for name, model in models.items():
        losses[name] = make_step(model, 3, 12)()
        grads[name] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    worst = max(
        float((a - b).norm() / b.norm().clamp_min(1e-30))
        for a, b in zip(grads["memfit"], grads["naive"])
    )
    return {
        "loss_rel_err": abs(losses["memfit"] - losses["naive"]) / abs(losses["naive"]),
        "max_grad_rel_err": worst,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    naive = Seq2Seq(args.vocab, args.emb, args.hidden, args.attn, "naive")
    fused = Seq2Seq(args.vocab, args.emb, args.hidden, args.attn, "memfit")
    fused.load_state_dict(naive.state_dict())
    models = {"naive": naive, "memfit": fused}
    check = agreement(models)
    print(f"memfit vs naive on one small batch: {check}", flush=True)

    lengths = sorted(args.lengths)
    probes: dict[str, dict[int, dict[int, int]]] = {m: {t: {} for t in lengths} for m in METHODS}
    if args.budget_mib is None:
        top = probes["naive"][lengths[-1]]
        for b in (NAIVE_TARGET_BATCH, NAIVE_TARGET_BATCH + 1):
            top[b] = step_peak(naive, b, lengths[-1])
        budget = (top[NAIVE_TARGET_BATCH] + top[NAIVE_TARGET_BATCH + 1]) // 2
        budget = (budget + MIB // 2) // MIB * MIB
        how = (
            f"midpoint of naive's measured peaks at batch {NAIVE_TARGET_BATCH} and "
            f"{NAIVE_TARGET_BATCH + 1} at T={lengths[-1]}, rounded to MiB"
        )
    else:
        budget, how = int(args.budget_mib * MIB), "--budget-mib"
    print(f"budget {budget / MIB:.0f} MiB ({how})", flush=True)

    rows = []
    for length in lengths:
        row: dict[str, Any] = {"T": length}
        for method in METHODS:
            best, seen = largest_batch(models[method], length, budget, probes[method][length])
            row[method] = {
                "largest_batch": best,
                "peak_bytes_at_largest": seen.get(best),
                "probes": {str(b): p for b, p in sorted(seen.items())},
            }
        naive_b, fused_b = row["naive"]["largest_batch"], row["memfit"]["largest_batch"]
        row["batch_ratio"] = fused_b / naive_b if naive_b else None
        common = max(naive_b, 1)
        times = median_step_times(models, common, length, args.repeats)
        row["timing_batch"] = common
        row["step_time_s"] = times
        row["time_ratio"] = times["memfit"] / times["naive"]
        rows.append(row)
        print(
            f"T={length:4d}  largest batch naive {naive_b:4d}  memfit {fused_b:5d}  "
            f"ratio {row['batch_ratio'] or float('nan'):5.1f}x  step time at batch {common}: "
            f"naive {times['naive']:.3f} s, memfit {times['memfit']:.3f} s "
            f"({row['time_ratio']:.2f}x)",
            flush=True,
        )
    return {
        "budget_bytes": budget,
        "budget_rule": how,
        "agreement_small_batch": check,
        "rows": rows,
    }


def per_sample_bytes(probes: dict[str, int]) -> float:
    """Peak bytes added per sample: the slope between the two largest probed batches."""
    (a, pa), (b, pb) = sorted((int(k), v) for k, v in probes.items())[-2:]
    return (pb - pa) / (b - a)


def write_markdown(report: dict[str, Any], path: Path) -> None:
    p, m = report["parameters"], report["machine"]
    lines = [
        f"# Additive attention in a seq2seq model: largest batch within a budget "
        f"({report['date_utc']})",
        "",
        f"Budget {report['budget_bytes'] / MIB:.0f} MiB of step peak tensor memory "
        f"({report['budget_rule']}), measured exactly with `memfit.measure`. Model: vocabulary "
        f"{p['vocab']}, embedding {p['emb']}, bidirectional GRU encoder {p['hidden']} per "
        f"direction, GRU-cell decoder {p['hidden']}, attention width H = {p['attn']}. torch "
        f"{report['software']['torch']} on a {m.get('cpu_count')}-core "
        f"{m.get('cpu_model') or m.get('processor')}, {m.get('torch_threads')} threads; load "
        f"average {report['load_average']['start']} at start, {report['load_average']['end']} "
        f"at end. Step time: median of {p['repeats']} interleaved runs at naive's largest batch.",
        "",
        "Per sample: the step peak's growth per added sample (slope between the two largest "
        "probes), what sets each largest batch. memfit's is the rest of the model (GRU cells, "
        "read-out, their gradients), linear in T; naive's adds the T² · H tanh outputs.",
        "",
        "| T | naive batch | memfit batch | batch ratio | naive per sample | memfit per sample "
        "| timing batch | naive step | memfit step | time ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["rows"]:
        ratio = row["batch_ratio"]
        per_sample = [per_sample_bytes(row[m]["probes"]) / MIB for m in METHODS]
        lines.append(
            f"| {row['T']} | {row['naive']['largest_batch']} | {row['memfit']['largest_batch']} "
            f"| {'-' if ratio is None else f'{ratio:.1f}x'} | {per_sample[0]:.2f} MiB "
            f"| {per_sample[1]:.2f} MiB | {row['timing_batch']} "
            f"| {row['step_time_s']['naive']:.3f} s | {row['step_time_s']['memfit']:.3f} s "
            f"| {row['time_ratio']:.2f}x |"
        )
    path.write_text("\n".join(lines) + "\n")


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rows = report["rows"]
    lengths = [r["T"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for method, marker in (("naive", "o"), ("memfit", "s")):
        left.plot(lengths, [r[method]["largest_batch"] for r in rows], marker=marker, label=method)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(t) for t in lengths])
        ax.minorticks_off()
    left.set_yscale("log", base=2)
    left.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    left.set_xlabel("sequence length T")
    left.set_ylabel("largest batch within budget")
    left.set_title(f"budget {report['budget_bytes'] / MIB:.0f} MiB (exact CPU peak)")
    left.legend()
    right.plot(lengths, [r["time_ratio"] for r in rows], marker="s", color="C1")
    right.axhline(1.0, color="grey", lw=0.8)
    right.set_xlabel("sequence length T")
    right.set_ylabel("memfit step time / naive step time")
    right.set_title("one training step at naive's largest batch")
    fig.suptitle("Additive attention seq2seq (Meng et al. 2017, Table 3) on CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="T = 25, 50; outputs get '_quick'")
    parser.add_argument("--lengths", type=int, nargs="+", help=f"default {LENGTHS}")
    parser.add_argument("--budget-mib", type=float, help="default: naive gets batch 2 at max T")
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--emb", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64, help="GRU width (encoder per direction)")
    parser.add_argument("--attn", type=int, default=256, help="attention width H")
    parser.add_argument("--repeats", type=int, help="timed runs per method; default 5, quick 3")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--suffix", default="", help="appended to the output files' names")
    args = parser.parse_args()
    if args.lengths is None:
        args.lengths = list(QUICK_LENGTHS if args.quick else LENGTHS)
    if args.repeats is None:
        args.repeats = 3 if args.quick else 5

    load_start = load_average()
    result = run(args)
    report = {
        "benchmark": "additive_seq2seq",
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "software": software_info(ROOT),
        "parameters": {
            "quick": args.quick,
            "lengths": args.lengths,
            "vocab": args.vocab,
            "emb": args.emb,
            "hidden": args.hidden,
            "attn": args.attn,
            "repeats": args.repeats,
            "naive_target_batch": NAIVE_TARGET_BATCH,
        },
        **result,
        "load_average": {"start": load_start, "end": load_average()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / ("additive_seq2seq" + ("_quick" if args.quick else "") + args.suffix)
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    write_markdown(report, stem.with_suffix(".md"))
    plot(report, stem.with_suffix(".png"))
    print(f"wrote {stem}.json, .md, .png")


if __name__ == "__main__":
    main()
