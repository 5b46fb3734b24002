"""Variable sequence lengths: does every step save memory, and what do new lengths cost?

A GPT-2 (HuggingFace ``GPT2LMHeadModel``: GPT-2's architecture and defaults, dropout 0.1
included) trained for 60 steps on batches whose sequence length is drawn (seeded) from 20
values, plain eager PyTorch against ``memfit.step`` with the loss inside, under ``"memory"`` and
a budget. The model is GPT-2's 12 layers with a narrower width (4 heads of 64, width 256) and a
vocabulary of 8,192, so that 60 steps take minutes on two CPU cores, not hours; at GPT-2's own
width and vocabulary the parameters' gradients and the logits dominate a CPU-sized step.

Two passes over the same 60 lengths, each starting from fresh captures:

* **timed**: nothing measured; eager and each memfit variant take turns step by step (so a
  change of machine load hits all of them), each a whole training step (forward, backward,
  AdamW, ``zero_grad``); memfit's time includes its captures. One torch thread.
* **measured**: every step's peak measured exactly (``memfit.measure``, CPU allocator
  accounting), eager and memfit at the same length; memfit's prediction read after each call
  (the plan of the graph that just ran, at its sizes).

Writes ``benchmarks/results/variable_shapes.{json,md}`` (``--out`` elsewhere; ``--quick``: one
layer, a 2,048-word vocabulary, 6 steps, without the every-length variant, into
``variable_shapes_quick.*``). Run:
``.venv/bin/python benchmarks/variable_shapes.py [--quick]``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import random
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

import memfit
from memfit._compat import automatic_dynamic_shapes
from memfit.bench.environment import load_average, machine_info, software_info

RESULTS = Path(__file__).resolve().parent / "results"
MiB = 2**20

#: The variants memfit runs, as ``memfit.step`` options.
VARIANTS: dict[str, dict[str, Any]] = {
    "memory": {"policy": "memory"},
    "budget=0.5": {"policy": 0.5},
}

#: Timed only: ``"memory"`` with every new length captured and planned again, as memfit did
#: before one capture served many sizes (Dynamo's automatic dynamic shapes turned off around
#: its calls), for the time that saves.
PER_LENGTH = "memory, every length captured"


def make_model(layers: int, vocab: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=layers,
        n_head=4,
        n_embd=256,
        vocab_size=vocab,
        n_positions=1024,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # transformers would log (a graph break) on every call
    return model.train()


def loss_of(model: nn.Module, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    def loss(ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = model(input_ids=ids, labels=ids, use_cache=False).loss
        return out

    # Dynamo remembers per function (file, line, qualified name) which sizes varied: one name
    # per runner, so no runner's capture decides what another captures.
    loss.__code__ = loss.__code__.replace(co_name=f"loss_{name}", co_qualname=f"loss_{name}")
    return loss


class Runner:
    """One model and optimizer, trained either plainly or through a ``memfit.step``."""

    def __init__(
        self, model: nn.Module, name: str, options: dict[str, Any] | None, static: bool = False
    ) -> None:
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        loss = loss_of(model, "".join(c if c.isalnum() else "_" for c in name))
        self.step = memfit.step(loss, **options) if options is not None else None
        self.loss = self.step if self.step is not None else loss
        self.static = static

    def forward_backward(self, ids: torch.Tensor) -> None:
        if self.static:
            with automatic_dynamic_shapes(False):
                self.loss(ids).backward()
        else:
            self.loss(ids).backward()

    def train(self, ids: torch.Tensor) -> None:
        self.forward_backward(ids)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    @property
    def captures(self) -> int:
        return self.step._planned.shapes_planned if self.step is not None else 0


def runners(model: nn.Module, variants: list[str], per_length: bool = False) -> dict[str, Runner]:
    out = {"eager": Runner(copy.deepcopy(model), "eager", None)}
    for name in variants:
        out[name] = Runner(copy.deepcopy(model), name, VARIANTS[name])
    if per_length:
        out[PER_LENGTH] = Runner(copy.deepcopy(model), PER_LENGTH, VARIANTS["memory"], True)
    return out


def timed_pass(
    model: nn.Module, variants: list[str], batches: list[torch.Tensor], per_length: bool
) -> list[dict]:
    torch.compiler.reset()
    run = runners(model, variants, per_length)
    rows = []
    for i, ids in enumerate(batches):
        order = list(run) if i % 2 == 0 else list(reversed(run))
        row: dict[str, Any] = {"step": i, "length": ids.shape[1]}
        for name in order:
            before = run[name].captures
            batch = ids.clone()  # Dynamo marks a tensor it saw vary: one copy per runner
            start = time.perf_counter()
            run[name].train(batch)
            row[f"{name}_s"] = time.perf_counter() - start
            row[f"{name}_captured"] = run[name].captures > before
        rows.append(row)
        print(
            f"timed {i:2d} L={ids.shape[1]:3d} "
            + " ".join(f"{n} {row[f'{n}_s']:.2f}s" for n in run),
            flush=True,
        )
    return rows


def measured_pass(model: nn.Module, variants: list[str], batches: list[torch.Tensor]) -> list[dict]:
    torch.compiler.reset()
    run = runners(model, variants)
    rows = []
    for i, ids in enumerate(batches):
        row: dict[str, Any] = {"step": i, "length": ids.shape[1]}
        for name, runner in run.items():
            before = runner.captures
            batch = ids.clone()  # Dynamo marks a tensor it saw vary: one copy per runner
            measured = memfit.measure(lambda r=runner, b=batch: r.forward_backward(b))
            row[f"{name}_peak"] = int(measured.peak_bytes or 0)
            runner.optimizer.step()
            runner.optimizer.zero_grad(set_to_none=True)
            if runner.step is not None:
                plan = runner.step.plan
                row[f"{name}_predicted"] = plan.predicted_peak_bytes
                row[f"{name}_sizes"] = plan.sizes
                row[f"{name}_planned_at"] = dict(plan.graphs[0].planned_sizes)
                row[f"{name}_range"] = [list(r) for r in plan.graphs[0].size_range]
                row[f"{name}_captured"] = runner.captures > before
                row[f"{name}_budget"] = plan.budget_bytes
        rows.append(row)
        print(
            f"measured {i:2d} L={ids.shape[1]:3d} "
            + " ".join(f"{n} {row[f'{n}_peak'] / MiB:.1f}" for n in run),
            flush=True,
        )
    return rows


def summary(result: dict[str, Any]) -> dict[str, Any]:
    timed, measured = result["timed"], result["measured"]
    eager_s = sum(r["eager_s"] for r in timed)
    out: dict[str, Any] = {"eager_s": eager_s}
    if result["per_length"]:
        total = sum(r[f"{PER_LENGTH}_s"] for r in timed)
        out[PER_LENGTH] = {
            "total_s": total,
            "ratio_to_eager": total / eager_s,
            "captures": sum(1 for r in timed if r[f"{PER_LENGTH}_captured"]),
            "capture_steps_s": sum(
                r[f"{PER_LENGTH}_s"] for r in timed if r[f"{PER_LENGTH}_captured"]
            ),
        }
    for name in result["variants"]:
        total = sum(r[f"{name}_s"] for r in timed)
        capturing = [r[f"{name}_s"] for r in timed if r[f"{name}_captured"]]
        steady = [r[f"{name}_s"] / r["eager_s"] for r in timed if not r[f"{name}_captured"]]
        savings = [1 - r[f"{name}_peak"] / r["eager_peak"] for r in measured]
        errors = [
            abs(r[f"{name}_peak"] - r[f"{name}_predicted"]) / r[f"{name}_peak"] for r in measured
        ]
        # The plan describes the call that ran: a graph with the length as a symbol reports the
        # call's length (a static graph runs only at the length it was captured at).
        described = [
            not r[f"{name}_sizes"] or list(r[f"{name}_sizes"].values()) == [r["length"]]
            for r in measured
        ]
        over_budget = [
            r for r in measured if r[f"{name}_budget"] and r[f"{name}_peak"] > r[f"{name}_budget"]
        ]
        out[name] = {
            "total_s": total,
            "ratio_to_eager": total / eager_s,
            "captures": sum(1 for r in timed if r[f"{name}_captured"]),
            "capture_steps_s": sum(capturing),
            "steady_step_ratio_median": statistics.median(steady) if steady else None,
            "min_saving": min(savings),
            "median_saving": statistics.median(savings),
            "steps_saving_30pct": sum(1 for s in savings if s >= 0.30),
            "max_prediction_error": max(errors),
            "plans_describe_the_call": all(described),
            "steps_over_budget": len(over_budget),
        }
    return out


def markdown(result: dict[str, Any]) -> str:
    s = result["summary"]
    m, sw = result["machine"], result["software"]
    lines = [
        "# Variable sequence lengths (benchmarks/variable_shapes.py)",
        "",
        f"{result['model']}; batch {result['batch']}, {len(result['timed'])} steps, lengths drawn "
        f"(seed 0) from {result['lengths']}. {m.get('cpu_model', m.get('processor'))}, "
        f"{m.get('cpu_count')} cores, {result['threads']} torch thread; torch {sw['torch']}; "
        f"{result['date']}; load average {result['load_average']} at the start, "
        f"{result['load_average_end']} at the end.",
        "",
        "| | eager | " + " | ".join(f"memfit `{n}`" for n in result["variants"]) + " |",
        "| --- | ---: | " + " | ".join("---:" for _ in result["variants"]) + " |",
        f"| whole run (timed pass), captures included | {s['eager_s']:.1f} s | "
        + " | ".join(
            f"{s[n]['total_s']:.1f} s ({s[n]['ratio_to_eager']:.2f}x)" for n in result["variants"]
        )
        + " |",
        "| captures | - | " + " | ".join(f"{s[n]['captures']}" for n in result["variants"]) + " |",
        "| time of the capturing steps | - | "
        + " | ".join(f"{s[n]['capture_steps_s']:.1f} s" for n in result["variants"])
        + " |",
        "| other steps, median time / eager's | 1 | "
        + " | ".join(f"{s[n]['steady_step_ratio_median']:.2f}" for n in result["variants"])
        + " |",
        "| steps saving >= 30% of eager's peak | - | "
        + " | ".join(
            f"{s[n]['steps_saving_30pct']} of {len(result['measured'])}" for n in result["variants"]
        )
        + " |",
        "| least / median saving | - | "
        + " | ".join(
            f"{s[n]['min_saving']:.0%} / {s[n]['median_saving']:.0%}" for n in result["variants"]
        )
        + " |",
        "| largest \\|measured - predicted\\| / measured | - | "
        + " | ".join(f"{s[n]['max_prediction_error']:.2%}" for n in result["variants"])
        + " |",
        "| steps above their budget | - | "
        + " | ".join(
            str(s[n]["steps_over_budget"]) if n.startswith("budget") else "-"
            for n in result["variants"]
        )
        + " |",
        "",
        *(
            [
                f"Before one capture served many lengths (`memory` with every new length captured "
                f"and planned, timed in the same interleaved pass): "
                f"{s[PER_LENGTH]['total_s']:.1f} s ({s[PER_LENGTH]['ratio_to_eager']:.2f}x eager), "
                f"{s[PER_LENGTH]['captures']} captures taking "
                f"{s[PER_LENGTH]['capture_steps_s']:.1f} s.",
                "",
            ]
            if PER_LENGTH in s
            else []
        ),
        "Per step (measured pass; MiB; `*` marks a step that captured):",
        "",
        "| step | length | eager peak | "
        + " | ".join(f"`{n}` peak | predicted | saving" for n in result["variants"])
        + " |",
        "| ---: | ---: | ---: | "
        + " | ".join("---: | ---: | ---:" for _ in result["variants"])
        + " |",
    ]
    for r in result["measured"]:
        cells = []
        for n in result["variants"]:
            mark = "*" if r[f"{n}_captured"] else ""
            cells.append(
                f"{r[f'{n}_peak'] / MiB:.1f}{mark} | {r[f'{n}_predicted'] / MiB:.1f} | "
                f"{1 - r[f'{n}_peak'] / r['eager_peak']:.0%}"
            )
        lines.append(
            f"| {r['step']} | {r['length']} | {r['eager_peak'] / MiB:.1f} | "
            + " | ".join(cells)
            + " |"
        )
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="1 layer, 6 steps, no every-length variant"
    )
    parser.add_argument("--variants", default=",".join(VARIANTS), help="memfit variants to run")
    parser.add_argument(
        "--no-per-length",
        action="store_true",
        help=f"leave out the timed-only variant {PER_LENGTH!r} (captures every length)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    layers, steps, vocab, batch = (1, 6, 2048, 2) if args.quick else (12, 60, 8192, 4)
    lengths = [64 + 16 * i for i in range(20)]
    draw = random.Random(0)
    g = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, vocab, (batch, draw.choice(lengths)), generator=g) for _ in range(steps)
    ]
    variants = [v for v in args.variants.split(",") if v]
    model = make_model(layers, vocab)
    result: dict[str, Any] = {
        "benchmark": "variable_shapes",
        "model": f"HF GPT2LMHeadModel, {layers} layers, 4 heads x 64 (width 256), vocabulary "
        f"{vocab}, dropout 0.1, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
        "parameters",
        "batch": batch,
        "lengths": lengths,
        "threads": torch.get_num_threads(),
        "variants": variants,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "software": software_info(Path(__file__).resolve().parents[1]),
        "load_average": load_average(),
    }
    result["per_length"] = not (args.no_per_length or args.quick)
    name = "variable_shapes_quick" if args.quick else "variable_shapes"
    args.out.mkdir(parents=True, exist_ok=True)
    partial = args.out / f"{name}.partial.json"
    result["timed"] = timed_pass(model, variants, batches, result["per_length"])
    partial.write_text(json.dumps(result, indent=1))  # a long run keeps its first pass
    result["measured"] = measured_pass(model, variants, batches)
    result["load_average_end"] = load_average()
    result["summary"] = summary(result)
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=1))
    (args.out / f"{name}.md").write_text(markdown(result))
    partial.unlink(missing_ok=True)
    print(markdown(result))


if __name__ == "__main__":
    main()
