"""memfit on HuggingFace models: measured peak, predicted peak and step time against what a user
would do by hand.

For GPT-2, Llama (grouped-query attention, rotary), BERT (masked LM), T5 (encoder-decoder) and
Llama + peft LoRA (frozen base), in fp32 and under bf16 autocast, one training step as
``Trainer`` runs it (``model(**batch).loss.backward()``, gradients None before each step) is run
with plain PyTorch, HF's ``gradient_checkpointing_enable()`` (non-reentrant), per-block
``torch.utils.checkpoint`` applied by ``apply_activation_checkpointing`` to every decoder/encoder
layer (as torchtitan and FSDP users do), and memfit ``"none"``, ``"memory"`` and budgets 0.5 and
0.3 of plain's activations. memfit's warm-up steps (``bench.runner.first_step``: planning, and
planning again after what the first backwards showed) are not measured; then ``STEPS`` steps are
measured one by one (exact allocator accounting on CPU, the allocator's statistics on CUDA), each
against the prediction the plan made for it, and ``TIMED`` unmeasured steps are timed (median).

Writes ``benchmarks/results/hf_models/hf_models-<device>.json`` and ``.md`` naming machine, torch
and date (``--out`` elsewhere). Run: ``.venv/bin/python benchmarks/hf_models.py [--device cuda]
[--models gpt2,llama] [--dtypes fp32,bf16] [--methods plain,memory] [--width 256 --layers 4
--batch 8 --length 128]`` (CPU, all: about 12 minutes on 2 cores). ``--quick``: GPT-2 in fp32,
plain, HF checkpointing and ``"memory"``, width 128, 2 layers, batch 2 x 64 (each unless given),
into ``hf_models-<device>_quick.*``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

import memfit
from memfit.bench.environment import load_average, machine_info, software_info
from memfit.bench.runner import Method, first_step
from memfit.measurement.timing import synchronize

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "hf_models"
MiB = 2**20
#: measured steps per method (the first is reported apart: the first step after warm-up)
STEPS = 3
#: timed steps per method (median reported)
TIMED = 5
MODELS = ("gpt2", "llama", "bert", "t5", "llama_lora")
DTYPES = ("fp32", "bf16")
METHODS = ("plain", "hf_gc", "per_block", "none", "memory", "budget 0.5", "budget 0.3")
#: The sweep's defaults, and ``--quick``'s (each where not given on the command line).
FULL: dict[str, object] = {
    "models": ",".join(MODELS),
    "dtypes": ",".join(DTYPES),
    "methods": ",".join(METHODS),
    "width": 256,
    "layers": 4,
    "batch": 8,
    "length": 128,
}
QUICK: dict[str, object] = {
    "models": "gpt2",
    "dtypes": "fp32",
    "methods": "plain,hf_gc,memory",
    "width": 128,
    "layers": 2,
    "batch": 2,
    "length": 64,
}


def make_model(name: str, width: int, layers: int) -> tuple[torch.nn.Module, type]:
    """The model (seed 0) and the class of its blocks (what per-block checkpointing wraps)."""
    import transformers

    torch.manual_seed(0)
    vocab = 2048
    if name == "gpt2":
        config = transformers.GPT2Config(
            n_embd=width, n_layer=layers, n_head=width // 64, vocab_size=vocab, n_positions=512
        )
        config.attn_implementation = "sdpa"
        model = transformers.GPT2LMHeadModel(config)
        return model, type(model.transformer.h[0])
    if name in ("llama", "llama_lora"):
        config = transformers.LlamaConfig(
            hidden_size=width,
            intermediate_size=width * 8 // 3,
            num_hidden_layers=layers,
            num_attention_heads=width // 32,
            num_key_value_heads=width // 128,
            vocab_size=vocab,
            max_position_embeddings=512,
            attn_implementation="sdpa",
        )
        model = transformers.LlamaForCausalLM(config)
        block = type(model.model.layers[0])
        if name == "llama_lora":
            import peft

            lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
            model = peft.get_peft_model(model, lora)
        return model, block
    if name == "bert":
        config = transformers.BertConfig(
            hidden_size=width,
            num_hidden_layers=layers,
            num_attention_heads=width // 64,
            intermediate_size=width * 4,
            vocab_size=vocab,
            max_position_embeddings=512,
            attn_implementation="sdpa",
        )
        model = transformers.BertForMaskedLM(config)
        return model, type(model.bert.encoder.layer[0])
    if name == "t5":
        config = transformers.T5Config(
            d_model=width,
            d_kv=64,
            d_ff=width * 4,
            num_layers=layers,
            num_decoder_layers=layers,
            num_heads=width // 64,
            vocab_size=vocab,
            decoder_start_token_id=0,
            pad_token_id=0,
        )
        model = transformers.T5ForConditionalGeneration(config)
        return model, type(model.encoder.block[0])
    raise ValueError(f"no model named {name!r}")


def make_batch(name: str, batch: int, length: int, device: torch.device) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 2048, (batch, length), generator=g)
    labels = torch.randint(1, 2048, (batch, length), generator=g)
    out: dict[str, Any] = {"input_ids": ids, "labels": labels}
    if name == "bert":
        out["attention_mask"] = torch.ones_like(ids)
    if name == "t5":
        out["labels"] = labels[:, : length // 2].contiguous()
    return {k: v.to(device) for k, v in out.items()}


def _apply(method: str, model: torch.nn.Module, block: type) -> torch.nn.Module:
    if method == "hf_gc":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif method == "per_block":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            apply_activation_checkpointing,
        )

        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, block))
        # as HF's own checkpointing does in training (the cache is never read there)
        model.config.use_cache = False
    elif method in ("none", "memory"):
        memfit.checkpoint(model, method)
    elif method.startswith("budget"):
        memfit.checkpoint(model, float(method.split()[1]))
    return model


def run_method(
    name: str,
    dtype: str,
    method: str,
    device: torch.device,
    width: int,
    layers: int,
    batch: int,
    length: int,
) -> dict[str, Any]:
    """One row: the method's warm-up, measured steps and timed steps."""
    model, block = make_model(name, width, layers)
    model.to(device).train()
    model = _apply(method, model, block)
    data = make_batch(name, batch, length, device)
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if dtype == "bf16"
        else contextlib.nullcontext()
    )

    def step() -> None:
        with autocast:
            loss = model(**data).loss
        loss.backward()

    state = model.memfit if isinstance(model, memfit.CheckpointedModule) else None
    runner = Method(f"{name} {dtype} {method}", model, step, record_failures=False)
    row: dict[str, Any] = {"model": name, "dtype": dtype, "method": method}
    try:
        # the first step, then memfit's own settling (bench.runner): planned again for what the
        # first backwards showed, before anything is measured
        row["first_step_s"] = first_step(runner, device)
    except memfit.BudgetError as err:
        row["refused"] = str(err)
        return row
    peaks, predicted = [], []
    for _ in range(STEPS):
        runner.zero_grad()
        peaks.append(int(memfit.measure(step, device=device).peak_bytes or 0))
        if state is not None:
            predicted.append(state.plan.predicted_peak_bytes)
    row["peaks"] = peaks
    row["predicted"] = predicted
    if state is not None:
        row["replan_pending_after"] = state.replan_pending
    times = []
    for _ in range(TIMED):
        runner.zero_grad()
        synchronize(device)
        t = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - t)
    row["step_s"] = statistics.median(times)
    row["step_s_all"] = times
    return row


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"# memfit on HuggingFace models ({meta['device']})",
        "",
        f"{meta['date']}, {meta['machine'].get('cpu_model', '')} "
        f"{meta['machine'].get('gpu') or ''}, "
        f"torch {meta['software'].get('torch')}, transformers "
        f"{meta['software'].get('transformers', '')}; {meta['shape']}. Peak: bytes above the "
        "step's start, first measured step after warm-up and the worst of the others; "
        "prediction error: worst over the measured steps; time: median step.",
        "",
        "| model | dtype | method | peak (MiB) first / later | x plain | predicted (MiB) "
        "| error | step (ms) | x HF GC |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    base: dict[tuple[str, str, str], dict[str, Any]] = {
        (r["model"], r["dtype"], r["method"]): r for r in rows
    }
    for r in rows:
        key = (r["model"], r["dtype"])
        if "refused" in r:
            lines.append(f"| {key[0]} | {key[1]} | {r['method']} | refused | | | | | |")
            continue
        if "error" in r:
            lines.append(f"| {key[0]} | {key[1]} | {r['method']} | failed | | | | | |")
            continue
        plain = base.get((*key, "plain"), {}).get("peaks")
        gc = base.get((*key, "hf_gc"), {}).get("step_s")
        peaks = r["peaks"]
        ratio = f"{max(peaks) / max(plain):.2f}" if plain else ""
        pred = r.get("predicted") or []
        err = max((p / m - 1 for p, m in zip(pred, peaks)), key=abs) if pred else None
        vs_gc = f"{r['step_s'] / gc:.2f}" if gc else ""
        lines.append(
            f"| {key[0]} | {key[1]} | {r['method']} | {peaks[0] / MiB:.2f} / "
            f"{max(peaks[1:]) / MiB:.2f} | {ratio} | "
            f"{'' if not pred else f'{max(pred) / MiB:.2f}'} | "
            f"{'' if err is None else f'{err:+.1%}'} | {r['step_s'] * 1e3:.0f} | "
            f"{vs_gc} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="GPT-2, fp32, 3 methods, small")
    parser.add_argument("--models", help=f"default {','.join(MODELS)}")
    parser.add_argument("--dtypes", help=f"default {','.join(DTYPES)}")
    parser.add_argument("--methods", help=f"default {','.join(METHODS)}")
    parser.add_argument("--width", type=int, help="default 256")
    parser.add_argument("--layers", type=int, help="default 4")
    parser.add_argument("--batch", type=int, help="default 8")
    parser.add_argument("--length", type=int, help="default 128")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    defaults = QUICK if args.quick else FULL
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    device = torch.device(args.device)
    import transformers

    software = software_info(ROOT)
    software["transformers"] = transformers.__version__
    meta = {
        "date": datetime.date.today().isoformat(),
        "device": str(device),
        "machine": machine_info(device),
        "software": software,
        "shape": f"width {args.width}, {args.layers} layers, batch {args.batch} x {args.length}",
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"hf_models-{device.type}" + ("_quick" if args.quick else "")
    rows: list[dict[str, Any]] = []

    def write() -> str:
        """Written after every row: a run cut short (a device's time limit) keeps its rows."""
        meta["load_average"] = load_average()
        (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        text = markdown(rows, meta)
        (out / f"{stem}.md").write_text(text)
        return text

    with warnings.catch_warnings(), contextlib.redirect_stdout(None):
        warnings.simplefilter("ignore")
        for name in args.models.split(","):
            for dtype in args.dtypes.split(","):
                for method in args.methods.split(","):
                    try:
                        row = run_method(
                            name,
                            dtype,
                            method,
                            device,
                            args.width,
                            args.layers,
                            args.batch,
                            args.length,
                        )
                    except Exception as err:  # noqa: BLE001 - recorded, the sweep goes on
                        row = {"model": name, "dtype": dtype, "method": method}
                        row["error"] = f"{type(err).__name__}: {err}"[:500]
                    rows.append(row)
                    torch.compiler.reset()
                    progress = {k: v for k, v in row.items() if k != "step_s_all"}
                    print(json.dumps(progress), file=sys.stderr, flush=True)
                    write()
    print(write())


if __name__ == "__main__":
    main()
