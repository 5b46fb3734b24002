"""Does ``memfit.fit``'s prediction, made on fake tensors, hold when the step runs for real?

Issue 67's item 6 on a GPU: a Llama of 1.1B parameters (TinyLlama's shape: hidden 2048, 22
layers, 32 heads, 4 key-value heads, intermediate 5632, vocabulary 32,000) in pure bf16 with
AdamW (foreach, torch's default on CUDA), sequence 2048.

1. **Planned on fake tensors**: the model is built under ``torch.device("meta")`` and
   ``memfit.fit`` predicts each policy's whole step (``max_memory_allocated``: weights, batch,
   AdamW's state and temporaries, activations) at each batch, on this machine's CPU, allocating
   nothing on the GPU.
2. **Measured**: the same model built for real on the GPU, ``memfit.checkpoint(model, policy)``,
   AdamW, three warm steps (the optimizer's state built, memfit's plan made and settled), then
   one step (forward with the loss inside the model, backward, ``optimizer.step()``,
   ``zero_grad()``) between ``reset_peak_memory_stats`` and ``max_memory_allocated``. The goal:
   within 5% of the prediction, never more than 2% above it (a prediction at most 2% under).
3. **The largest batch fit finds** for a smaller GPU, an RTX 4090 (24,564 MiB less 512 MiB of
   context), run for real on this GPU held to the 4090's usable bytes
   (``torch.cuda.set_per_process_memory_fraction``): it must run without running out of memory,
   and its measured peak must be within the 4090's usable bytes. The batch after it is run too
   and its outcome recorded (the allocator's slack, reserved above allocated, is not predicted).

``--device cpu`` rehearses the whole script here on a small Llama (``--quick`` sizes: 2 layers,
width 128, sequence 256), with a ``memfit.Device`` of type ``"cpu"`` standing for the small GPU
(no memory cap: the largest batch is only measured against it). Writes
``benchmarks/results/fit_accuracy[_cpu].{json,md}``; ``benchmarks/device/fit_run.sh`` runs it on a
lent GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import memfit
from memfit.bench.environment import load_average, report

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20

#: TinyLlama-1.1B's shape.
LLAMA_1B = dict(
    hidden_size=2048,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    intermediate_size=5632,
    vocab_size=32000,
)
#: the rehearsal's
LLAMA_SMALL = dict(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=352,
    vocab_size=2048,
)
POLICIES = ("none", "speed", "memory")


def build(shape: dict[str, Any], seq: int, device: str) -> torch.nn.Module:
    """The Llama on ``device`` (``"meta"``: shapes only), its weights made in ``shape["dtype"]``
    (pure training in it: gradients and AdamW's state too)."""
    import transformers

    config = transformers.LlamaConfig(
        **{k: v for k, v in shape.items() if k != "dtype"},
        max_position_embeddings=seq,
        attn_implementation="sdpa",
        use_cache=False,
    )
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(shape["dtype"])
    try:
        with torch.device(device):
            return transformers.LlamaForCausalLM(config).train()
    finally:
        torch.set_default_dtype(previous)


def predict(
    shape: dict[str, Any], seq: int, batch: int, policy: str, target: memfit.Device, search: bool
) -> dict[str, Any]:
    """``memfit.fit`` on a meta model: the predicted whole step, and the largest batch."""
    model = build(shape, seq, "meta")
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    started = time.perf_counter()
    rep = memfit.fit(
        model,
        device=target,
        policies=[policy],
        optimizer="adamw",
        implementation="foreach",
        search=search,
        limit=256,
        input_ids=ids,
        labels=ids,
    )
    row = rep.rows[0]
    return {
        "predicted_bytes": row.peak_bytes,
        "largest_batch": row.largest_batch,
        "exact": row.exact,
        "plan_s": round(time.perf_counter() - started, 1),
        "plans": row.plans,
    }


@contextlib.contextmanager
def _released() -> Iterator[None]:
    try:
        yield
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run(shape: dict[str, Any], seq: int, batch: int, policy: str, device: str) -> dict[str, Any]:
    """``_step_peak`` with everything it made released after it (model, optimizer, cache)."""
    with _released():
        return _step_peak(shape, seq, batch, policy, device)


def _step_peak(
    shape: dict[str, Any], seq: int, batch: int, policy: str, device: str
) -> dict[str, Any]:
    """One real step's peak after three warm ones, measured as ``fit`` predicts it: on CUDA
    ``max_memory_allocated`` (everything allocated, weights and state included); on CPU what
    was live before the step (weights, batch, optimizer state) + ``memfit.measure``'s peak."""
    model = build(shape, seq, device)
    memfit.checkpoint(model, policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape["vocab_size"], (batch, seq), generator=g).to(device)

    def step() -> None:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    try:
        for _ in range(3):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
            step()
            torch.cuda.synchronize()
            seconds = time.perf_counter() - started
            measured = torch.cuda.max_memory_allocated()
            reserved = torch.cuda.max_memory_reserved()
        else:
            state = [t for s in opt.state.values() for t in s.values()]
            live = {
                t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers(), ids, *state]
                if isinstance(t, torch.Tensor)
            }
            m = memfit.measure(step, device="cpu")
            seconds = m.time_s
            measured = sum(live.values()) + int(m.peak_bytes or 0)
            reserved = None
    except torch.OutOfMemoryError as err:
        return {"oom": str(err).splitlines()[0][:200]}
    return {"measured_bytes": measured, "reserved_bytes": reserved, "step_s": seconds}


def small_target(device: str) -> memfit.Device:
    """The smaller device whose largest batch is checked: an RTX 4090 on CUDA; on CPU a device
    of type ``"cpu"`` of 64 MiB (the rehearsal's model is small)."""
    if device == "cuda":
        return memfit.Device.named("rtx-4090")
    return memfit.Device("cpu-64mib", "64 MiB of this CPU", "cpu", 64 * MiB, context_bytes=0)


def markdown(rep: dict[str, Any]) -> str:
    p = rep["parameters"]
    lines = [
        f"# memfit.fit on fake tensors against the real step ({rep['date_utc']}, "
        f"{rep['machine'].get('gpu') or rep['machine'].get('cpu_model')}, "
        f"torch {rep['software']['torch']})",
        "",
        f"Llama {p['shape']} in pure {p['dtype']}, AdamW (foreach), sequence {p['seq']}. "
        "Predicted: "
        "`max_memory_allocated` of a whole step, planned on a meta model (nothing allocated). "
        "Measured: the fourth real step under `memfit.checkpoint`. Goal: within 5%, never "
        "more than 2% under.",
        "",
        "| policy | batch | predicted | measured | measured / predicted | reserved | step |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rep["accuracy"]:
        if "oom" in r:
            lines.append(
                f"| {r['policy']} | {r['batch']} | {r['predicted_bytes'] / MiB:,.1f} "
                f"MiB | out of memory | | | |"
            )
            continue
        res = "" if r["reserved_bytes"] is None else f"{r['reserved_bytes'] / MiB:,.1f} MiB"
        lines.append(
            f"| {r['policy']} | {r['batch']} | {r['predicted_bytes'] / MiB:,.1f} MiB | "
            f"{r['measured_bytes'] / MiB:,.1f} MiB | {r['ratio']:.4f} | {res} | "
            f"{r['step_s'] * 1e3:,.0f} ms |"
        )
    lines += [
        "",
        f"## The largest batch on {p['small_target']} ({p['small_usable_bytes'] / MiB:,.0f} MiB "
        "usable), run for real",
        "",
        "| policy | largest batch (fit) | measured at it | within | the batch after it |",
        "| --- | ---: | ---: | :---: | --- |",
    ]
    for r in rep["largest"]:
        at = r["at"]
        got = "out of memory" if "oom" in at else f"{at['measured_bytes'] / MiB:,.1f} MiB"
        nxt = r.get("after") or {}
        after = (
            "not run"
            if not nxt
            else "out of memory"
            if "oom" in nxt
            else f"{nxt['measured_bytes'] / MiB:,.1f} MiB"
        )
        lines.append(
            f"| {r['policy']} | {r['batch']} | {got} | {'yes' if r['within'] else 'no'} | {after} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="the small Llama (default on CPU)")
    ap.add_argument("--batches", default="1,2,4")
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="the weights' dtype (float32 on CPU: the fake planner does not model oneDNN's bf16 "
        "matmul scratch, docs/fit.md)",
    )
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)
    quick = args.quick or args.device == "cpu"
    shape, seq = (LLAMA_SMALL, 256) if quick else (LLAMA_1B, 2048)
    shape = {**shape, "dtype": getattr(torch, args.dtype)}
    batches = [int(b) for b in args.batches.split(",")]
    policies = args.policies.split(",")
    started, load_start = time.perf_counter(), load_average()
    if args.device == "cuda":
        here = torch.cuda.get_device_name()
        big = next(
            (memfit.Device.named(n) for n in ("h200", "h100-80gb") if n[:4] in here.lower()),
            None,
        )
        total = torch.cuda.mem_get_info()[1]
        target = big or memfit.Device("this-gpu", here, "cuda", total)
    else:
        target = memfit.Device("cpu", "this CPU", "cpu", 24 * 2**30, context_bytes=0)
    small = small_target(args.device)
    accuracy: list[dict[str, Any]] = []
    largest: list[dict[str, Any]] = []
    stem = args.out / ("fit_accuracy" + ("_cpu" if args.device == "cpu" else ""))
    args.out.mkdir(parents=True, exist_ok=True)

    def write(complete: bool) -> dict[str, Any]:
        rep = report(
            "fit_accuracy",
            ROOT,
            started,
            load_start,
            [],
            parameters={
                "shape": shape,
                "seq": seq,
                "dtype": args.dtype,
                "device": args.device,
                "target": target.name,
                "small_target": small.name,
                "small_usable_bytes": small.usable_bytes,
            },
            complete=complete,
        )
        if args.device == "cuda":
            rep["machine"]["gpu"] = torch.cuda.get_device_name()
        rep["accuracy"], rep["largest"] = accuracy, largest
        stem.with_suffix(".json").write_text(json.dumps(rep, indent=2, default=str) + "\n")
        stem.with_suffix(".md").write_text(markdown(rep))
        return rep

    for policy in policies:
        for batch in batches:
            row = {
                "policy": policy,
                "batch": batch,
                **predict(shape, seq, batch, policy, target, False),
            }
            row.update(run(shape, seq, batch, policy, args.device))
            if "measured_bytes" in row:
                row["ratio"] = row["measured_bytes"] / row["predicted_bytes"]
            print(json.dumps(row), flush=True)
            accuracy.append(row)
            write(False)
    if args.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(small.usable_bytes / total)
    for policy in policies:
        found = predict(shape, seq, 1, policy, small, True)
        b = found["largest_batch"] or 0
        rec: dict[str, Any] = {"policy": policy, "batch": b, "fit": found}
        rec["at"] = run(shape, seq, b, policy, args.device) if b else {"oom": "fits no batch"}
        rec["within"] = rec["at"].get("measured_bytes", small.usable_bytes + 1) <= (
            small.usable_bytes
        )
        if b:
            rec["after"] = run(shape, seq, b + 1, policy, args.device)
        print(json.dumps(rec), flush=True)
        largest.append(rec)
        write(False)
    rep = write(True)
    print(markdown(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
