"""How far torchgpipe's and DeepSpeed's stage balancers are from the optimal slowest stage.

A GPipe step takes ``(M - 1) * slowest stage + sum of stages``, so the slowest stage's ratio to
the optimum is the throughput lost. Compared, on the same chains, each method's slowest stage
(by per-layer time) divided by the optimum that memfit's pipeline planner finds: its cut search
(:func:`memfit.pipeline.balance_intervals`, as ``pipeline.cut_search`` calls it) on the same
per-layer costs, which is exact. With additive costs and free transfers a step's sum of stages is
the same for every partition, so the least step is the least slowest stage:

* ``torchgpipe``: ``torchgpipe.balance.balance_by_time`` = ``blockpartition.solve`` on profiled
  per-layer times (the block-partition heuristic of Bárány et al.), re-implemented below from
  kakaobrain/torchgpipe ``torchgpipe/balance/blockpartition.py`` (last changed in commit
  e50f2da0260c7a5fa9558bf033c52e636b0c75cd; read at a1b4ee25574864e7650e7905a69ce156da9752ec)
  and ``torchgpipe/balance/utils.py`` ``balance_cost``;
* ``deepspeed-parameters``: ``PipelineModule(partition_method="parameters")``, i.e.
  ``_partition_layers`` calling ``ds_utils.partition_balanced`` on per-layer trainable
  parameter counts; re-implemented from microsoft/DeepSpeed ``deepspeed/runtime/pipe/module.py``
  and ``deepspeed/runtime/utils.py`` (``partition_balanced``, a DP minimising the spread
  max - min of the stage sums, in place since commit 2bdf061f4dc8be70878f032d2e48d2130514f991,
  Dec 2023; read at 38327e07f6cd39b63418f60cedd1651b0be3e7c3, Feb 2025);
* ``deepspeed-dp-on-times``: the same DeepSpeed DP fed the per-layer times, to separate its
  objective (spread, not the largest stage) from its input (parameters, not time);
* ``uniform``: the same number of layers per stage (DeepSpeed's ``partition_method="uniform"``).

Both heuristics are written here from their source's algorithm, not copied. When written they
were checked against the originals (run from a local copy, outside this repository) on 20,000
random inputs each: identical stage sizes, including torchgpipe's empty stages and crossed cuts,
and the same inputs on which its loop never ends.

Chains:

* ``llm``: GPT-2-medium-shaped (d = 1024, 24 blocks, 16 heads, sequence 1024, vocabulary
  50,257) with an untied LM head: embedding, 24 equal blocks, head. Time per layer is its
  training FLOPs per token (forward + backward = 3x forward): a block 3 * (24 d² + 4 s d), the
  head 3 * 2 d V (3.5 blocks), the embedding memory-bound: 3 * 2 d bytes at 300 FLOP/byte (an
  H100's bf16 FLOPs over its bandwidth), 2% of a block. Parameters: embedding (V + s) d, block
  12 d² + 13 d, head d V + 2 d. Memory per layer: 16 bytes per parameter (mixed-precision Adam)
  plus GPipe's ``M = 8`` micro-batches of stored activations (Korthikanti et al. 2022, 16-bit:
  34 s d + 5 a s² bytes per block; the head's logits in 16 and 32 bits, 6 s V; the
  embedding's output, 2 s d);
* ``random``: chains of 4 to 40 layers, each a weight layer (time proportional to its
  parameters, times a log-uniform factor of 0.5-2 for its arithmetic intensity), a
  parameter-free layer (attention core, norm, activation: time only) or an embedding-like
  layer (parameters, little time), in proportions 60/30/10; K drawn from 2..min(8, layers).
  Memory: 16 bytes per parameter plus an activation size proportional to the layer's time
  times a log-uniform factor of 0.25-4.

Capacity: per chain and K, 1.1x the smallest per-stage capacity any partition into K stages
fits (the least, over partitions, of the largest stage's memory), so a feasible partition
always exists; counted: how often each method's partition exceeds it. memfit's search with the
capacity always fits; its slowest stage under the capacity is reported against the
unconstrained optimum (the price of fitting).

Writes benchmarks/results/pipeline_balance.{json,md,png} (``--quick``: ``pipeline_balance_quick``
files, 100 random chains).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from itertools import accumulate
from pathlib import Path
from typing import Any

from memfit.bench.environment import load_average, machine_info, software_info
from memfit.pipeline import balance_intervals

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

METHODS = ["torchgpipe", "deepspeed-parameters", "deepspeed-dp-on-times", "uniform"]


# ------------------------------------------------------------------- torchgpipe, re-implemented


def torchgpipe_block_partition(
    sequence: Sequence[float], partitions: int, max_moves: int | None = None
) -> list[int]:
    """Stage sizes from torchgpipe's ``blockpartition.solve`` (``balance_cost`` takes lengths).

    The algorithm as torchgpipe implements it: costs normalised to [0, 1] by (x - min) /
    (max - min); initial cut after every ``n // K`` items (the last stage takes the rest);
    then (1) p = the heaviest block (the largest index among equals); (2) stop when the
    heaviest block's size (as taken at step 1) is at most the lightest block's + 1 (in the
    normalised units); (3) q = the lightest block (the smallest index among equals); move one
    item into q from its neighbour h on p's side; if h is p, go to (1), else to (2).
    """
    n = len(sequence)
    if not 1 <= partitions <= n:
        raise ValueError(f"partitions must be in 1..{n}, got {partitions}")
    low = min(sequence)
    span = max(sequence) - low
    normal = [0.0 if span == 0 else (x - low) / span for x in sequence]
    ends = [n // partitions * (i + 1) for i in range(partitions - 1)] + [n]

    def block(i: int) -> float:
        return sum(normal[ends[i - 1] if i > 0 else 0 : ends[i]])

    moves = 0
    limit = 100 * n * partitions if max_moves is None else max_moves
    while True:
        heaviest, p = max((block(i), i) for i in range(partitions))
        while True:
            lightest, q = min((block(i), i) for i in range(partitions))
            if heaviest <= lightest + 1:
                starts = [0, *ends[:-1]]
                return [len(sequence[a:b]) for a, b in zip(starts, ends)]
            moves += 1
            if moves > limit:
                raise RuntimeError(f"block partition did not stop after {limit} moves")
            if p < q:
                h = q - 1
                ends[h] -= 1
            else:
                h = q + 1
                ends[q] += 1
            if p == h:
                break


# -------------------------------------------------------------------- DeepSpeed, re-implemented


def deepspeed_partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Stage sizes from ``ds_utils.partition_uniform``: ``n // K`` each, the first stages +1."""
    if num_items <= num_parts:
        bounds = [min(p, num_items) for p in range(num_parts + 1)]
    else:
        chunk, extra = divmod(num_items, num_parts)
        bounds = [p * chunk + min(p, extra) for p in range(num_parts + 1)]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def deepspeed_partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Stage sizes from ``ds_utils.partition_balanced`` (DeepSpeed since Dec 2023).

    A DP over (items, stages) that keeps, per state, one (largest, smallest) stage-sum pair and
    minimises their difference, taking the last split point among equals (``>=``); uniform
    when there are no more items than stages. O(n² K).
    """
    n, m = len(weights), num_parts
    if n <= m:
        return deepspeed_partition_uniform(n, m)
    inf = math.inf
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    dp_max = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_min = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_cost = [[inf] * (m + 1) for _ in range(n + 1)]
    position = [[0] * (m + 1) for _ in range(n + 1)]
    dp_max[0][0] = 0.0
    dp_cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                seg = prefix[i] - prefix[k]
                largest = max(dp_max[k][j - 1], seg)
                smallest = min(dp_min[k][j - 1], seg)
                spread = largest - smallest
                if dp_cost[i][j] >= spread:
                    dp_cost[i][j] = spread
                    dp_max[i][j] = largest
                    dp_min[i][j] = smallest
                    position[i][j] = k
    bounds = [n]
    for j in range(m, 0, -1):
        bounds.append(position[bounds[-1]][j])
    bounds.reverse()
    return [b - a for a, b in zip(bounds, bounds[1:])]


# ------------------------------------------------------------------------------------- chains


def llm_chain(microbatches: int = 8) -> dict[str, list[float]]:
    """GPT-2-medium-shaped chain: embedding, 24 blocks, untied head (see the module docstring)."""
    d, s, v, a, blocks = 1024, 1024, 50257, 16, 24
    flops_per_byte = 300.0
    block_time = 3.0 * (24 * d * d + 4 * s * d)
    times = [3.0 * 2 * d * flops_per_byte] + [block_time] * blocks + [3.0 * 2 * d * v]
    params = [float((v + s) * d)] + [float(12 * d * d + 13 * d)] * blocks + [float(d * v + 2 * d)]
    acts = [2.0 * s * d] + [34.0 * s * d + 5.0 * a * s * s] * blocks + [6.0 * s * v]
    memory = [16 * p + microbatches * x for p, x in zip(params, acts)]
    return {"times": times, "params": params, "memory": memory}


def random_chain(rng: random.Random) -> dict[str, list[float]]:
    n = rng.randint(4, 40)
    times, params, memory = [], [], []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.6:  # a weight layer: time follows its parameters
            p = 10 ** rng.uniform(5, 7.5)
            t = p * 2 ** rng.uniform(-1, 1)
        elif kind < 0.9:  # parameter-free: attention core, norm, activation
            p = 0.0
            t = 10 ** rng.uniform(4.5, 7)
        else:  # embedding-like: many parameters, little time
            p = 10 ** rng.uniform(6.5, 8)
            t = p * 10 ** rng.uniform(-3, -2)
        times.append(t)
        params.append(p)
        memory.append(16 * p + t * 4 ** rng.uniform(-1, 1))
    return {"times": times, "params": params, "memory": memory}


# ---------------------------------------------------------------------------------- comparison


def partitions(chain: dict[str, list[float]], k: int) -> dict[str, list[int] | None]:
    n = len(chain["times"])
    try:
        gpipe: list[int] | None = torchgpipe_block_partition(chain["times"], k)
    except RuntimeError:
        gpipe = None
    return {
        "torchgpipe": gpipe,
        "deepspeed-parameters": deepspeed_partition_balanced(chain["params"], k),
        "deepspeed-dp-on-times": deepspeed_partition_balanced(chain["times"], k),
        "uniform": deepspeed_partition_uniform(n, k),
    }


def _prefix(values: Sequence[float]) -> list[float]:
    return [0.0, *accumulate(float(v) for v in values)]


def stage_sums(values: Sequence[float], sizes: Sequence[int]) -> list[float]:
    """Each stage's sum of ``values`` for stage sizes ``sizes``, as differences of prefix sums
    (the numbers the search compares, so the optimum's ratio is exactly 1)."""
    prefix, ends = _prefix(values), [0, *accumulate(sizes)]
    return [prefix[b] - prefix[a] for a, b in zip(ends, ends[1:])]


def memfit_balance(
    times: Sequence[float],
    k: int,
    memory: Sequence[float] | None = None,
    capacity: float | None = None,
) -> list[int]:
    """Stage sizes from memfit's planner search (``balance_intervals``) on additive per-layer
    times and memory, transfers free; any ``M > 1`` gives the least slowest stage."""
    t = _prefix(times)
    if memory is None:
        return balance_intervals(len(t) - 1, k, microbatches=2, stage_time=lambda i, j: t[j] - t[i])
    m = _prefix(memory)
    return balance_intervals(
        len(t) - 1,
        k,
        microbatches=2,
        stage_time=lambda i, j: t[j] - t[i],
        stage_memory=lambda s, i, j: m[j] - m[i],
        capacity=capacity,
    )


def smallest_capacity(memory: list[float], k: int) -> float:
    """The least, over partitions into ``k`` stages, of the largest stage's memory."""
    return max(stage_sums(memory, memfit_balance(memory, k)))


def compare(chain: dict[str, list[float]], k: int) -> dict[str, Any]:
    """Each method's slowest stage over the optimum, and whether it fits 1.1x the tightest."""
    times, memory = chain["times"], chain["memory"]
    best_sizes = memfit_balance(times, k)
    best = max(stage_sums(times, best_sizes))
    capacity = 1.1 * smallest_capacity(memory, k)
    fitted = memfit_balance(times, k, memory=memory, capacity=capacity)
    row: dict[str, Any] = {
        "layers": len(times),
        "stages": k,
        "optimum": best,
        "capacity": capacity,
        "memfit": {"sizes": best_sizes, "ratio": 1.0},
        "memfit-capacity": {
            "sizes": fitted,
            "ratio": max(stage_sums(times, fitted)) / best,
            "fits": max(stage_sums(memory, fitted)) <= capacity,
        },
    }
    row["memfit"]["fits"] = max(stage_sums(memory, best_sizes)) <= capacity
    for name, sizes in partitions(chain, k).items():
        entry: dict[str, Any] = {"sizes": sizes}
        if sizes is None or min(sizes) < 1 or sum(sizes) != len(times):
            # torchgpipe's heuristic: an empty stage, crossed cuts or no end; GPipe rejects it
            entry.update(valid=False, ratio=None, fits=None)
        else:
            entry.update(
                valid=True,
                ratio=max(_sums(times, sizes)) / best,
                fits=max(_sums(memory, sizes)) <= capacity,
            )
        row[name] = entry
    return row


def _brief(entry: dict[str, Any]) -> list[Any]:
    """A method's result on one random chain as ``[ratio, fits]`` (None, None: no partition)."""
    ratio = entry["ratio"]
    return [None if ratio is None else round(ratio, 6), entry["fits"]]


def _sums(values: list[float], sizes: list[int]) -> list[float]:
    out, i = [], 0
    for size in sizes:
        out.append(math.fsum(values[i : i + size]))
        i += size
    return out


def _time(fn: Callable[[], object], repeats: int = 3) -> float:
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100 random chains, not 1,000")
    parser.add_argument("--chains", type=int, default=None, help="random chains (default 1000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    count = args.chains or (100 if args.quick else 1000)
    started = time.perf_counter()

    llm = llm_chain()
    llm_rows = [compare(llm, k) for k in (2, 4, 8)]
    rng = random.Random(args.seed)
    random_rows = []
    for _ in range(count):
        chain = random_chain(rng)
        k = rng.randint(2, min(8, len(chain["times"])))
        random_rows.append(compare(chain, k))

    names = ["memfit", "memfit-capacity", *METHODS]
    summary: dict[str, Any] = {}
    for name in names:
        valid = [r for r in random_rows if r[name].get("valid", True)]
        ratios = [r[name]["ratio"] for r in valid]
        summary[name] = {
            "valid": len(valid),
            "invalid": len(random_rows) - len(valid),
            "worst": max(ratios),
            "median": statistics.median(ratios),
            "mean": statistics.fmean(ratios),
            "optimal_share": sum(x <= 1 + 1e-12 for x in ratios) / len(ratios),
            "over_capacity": sum(not r[name]["fits"] for r in valid),
        }

    rng_big = random.Random(1)
    big = [rng_big.uniform(0, 1) for _ in range(300)]
    big_mem = [rng_big.uniform(0, 1) for _ in range(300)]
    timing = {
        "search_300_items_16_stages_s": _time(lambda: memfit_balance(big, 16)),
        "search_300_items_16_stages_capacity_s": _time(
            lambda: memfit_balance(big, 16, big_mem, 1.1 * smallest_capacity(big_mem, 16))
        ),
    }

    result = {
        "benchmark": "pipeline_balance",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "quick": args.quick,
        "machine": machine_info(),
        "software": software_info(ROOT),
        "load_average": load_average(),
        "sources": {
            "torchgpipe": "kakaobrain/torchgpipe torchgpipe/balance/blockpartition.py "
            "@ e50f2da0260c7a5fa9558bf033c52e636b0c75cd (repo HEAD "
            "a1b4ee25574864e7650e7905a69ce156da9752ec)",
            "deepspeed": "microsoft/DeepSpeed deepspeed/runtime/utils.py partition_balanced "
            "@ 2bdf061f4dc8be70878f032d2e48d2130514f991, pipe/module.py _partition_layers; "
            "read at 38327e07f6cd39b63418f60cedd1651b0be3e7c3",
        },
        "llm_chain": {"layers": llm, "rows": llm_rows},
        "random": {
            "chains": count,
            "seed": args.seed,
            "summary": summary,
            "row_format": "per method: [slowest stage / optimum, fits the capacity]",
            "rows": random_rows,
        },
        "timing": timing,
        "wall_s": time.perf_counter() - started,
    }
    stem = "pipeline_balance_quick" if args.quick else "pipeline_balance"
    args.out.mkdir(parents=True, exist_ok=True)
    # one line per random chain keeps the file readable and small
    text = json.dumps({**result, "random": {**result["random"], "rows": "ROWS"}}, indent=1)
    rows_text = ",\n".join(
        "  "
        + json.dumps(
            {
                "layers": r["layers"],
                "stages": r["stages"],
                "optimum": float(f"{r['optimum']:.6g}"),
                **{m: _brief(r[m]) for m in names},
            }
        )
        for r in random_rows
    )
    (args.out / f"{stem}.json").write_text(text.replace('"ROWS"', "[\n" + rows_text + "\n ]"))

    cpu = result["machine"].get("cpu_model", result["machine"]["processor"])
    plain_s = timing["search_300_items_16_stages_s"]
    capped_s = timing["search_300_items_16_stages_capacity_s"]
    lines = [
        f"Pipeline stage balance: slowest stage / optimum ({cpu}, torch "
        f"{result['software']['torch']}, {result['date']})",
        "",
        "| method | LLM K=2 | LLM K=4 | LLM K=8 | LLM over capacity | random worst | random "
        "median | random optimal | random over capacity | random no valid partition |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in names:
        llm_ratios = " | ".join(
            "invalid" if r[name]["ratio"] is None else f"{r[name]['ratio']:.3f}" for r in llm_rows
        )
        llm_over = sum(r[name]["fits"] is False for r in llm_rows)
        s = summary[name]
        lines.append(
            f"| {name} | {llm_ratios} | {llm_over}/3 | {s['worst']:.3f} | {s['median']:.3f} "
            f"| {100 * s['optimal_share']:.0f}% | {s['over_capacity']}/{s['valid']} "
            f"| {s['invalid']}/{count} |"
        )
    lines += [
        "",
        "Capacity: 1.1x the smallest per-stage memory any partition into K stages fits. "
        "memfit: the planner's search (`balance_intervals`) on the per-layer times; "
        "memfit-capacity: the same with each stage's memory within the capacity, its slowest "
        "stage over the unconstrained optimum. Ratios and capacity counts are over the "
        "partitions a method produced; 'no valid partition': torchgpipe's heuristic left a "
        "stage empty, crossed its cuts or did not stop (GPipe rejects such a balance).",
        "",
        f"The search on 300 items (a large model's candidate cuts), 16 stages: "
        f"{1000 * plain_s:.0f} ms; with a capacity: "
        f"{1000 * capped_s:.0f} ms (best of 3).",
        "",
        "| LLM chain | " + " | ".join(f"K={r['stages']} sizes" for r in llm_rows) + " |",
        "| --- | --- | --- | --- |",
    ]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(str(r[name]["sizes"]) for r in llm_rows) + " |")
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(result, args.out / f"{stem}.png")
    return 0


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = ["memfit", *METHODS]
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4.5))
    rows = result["llm_chain"]["rows"]
    width = 0.8 / len(methods)
    for i, name in enumerate(methods):
        xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(rows))]
        left.bar(xs, [r[name]["ratio"] or math.nan for r in rows], width, label=name)
    left.set_xticks(range(len(rows)), [f"K={r['stages']}" for r in rows])
    left.set_ylim(0.9, None)
    left.set_ylabel("slowest stage / optimum")
    left.set_title("LLM-like chain (embedding, 24 blocks, head)")
    left.legend(fontsize=8)
    random_rows = result["random"]["rows"]
    for name in methods:
        ratios = sorted(r[name]["ratio"] for r in random_rows if r[name]["ratio"] is not None)
        middle.plot(ratios, [(i + 1) / len(ratios) for i in range(len(ratios))], label=name)
    middle.set_xlabel("slowest stage / optimum")
    middle.set_ylabel("share of chains at or below")
    middle.set_title(f"{len(random_rows)} random chains, K = 2..8")
    middle.legend(fontsize=8)
    summary = result["random"]["summary"]
    names = ["memfit", "memfit-capacity", *METHODS]
    shares = [100 * summary[n]["over_capacity"] / max(summary[n]["valid"], 1) for n in names]
    labels = ["memfit, time only", "memfit, capacity given", *METHODS]
    right.barh(labels, shares, color=["C0", "C0", "C1", "C2", "C3", "C4"])
    right.invert_yaxis()
    right.set_xlabel("% of random chains over the per-stage capacity")
    right.set_title("capacity 1.1x the tightest that fits")
    fig.suptitle(
        f"Stage balance vs the exact optimum (torch {result['software']['torch']}, "
        f"{result['date'][:10]})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
