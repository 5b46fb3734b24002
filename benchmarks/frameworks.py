"""memfit inside the frameworks people train with: one step's peak per framework.

For each example under ``examples/`` (HF ``Trainer``, peft LoRA in both orders, accelerate,
Lightning, a plain loop), the framework's own training step (``model(**batch).loss.backward()``
as ``Trainer.training_step`` runs it, ``accelerator.backward``, ``LightningModule.training_step``
and its backward, ``loss.backward()``) is
measured with exact CPU allocator accounting (the shared runner's ``measure_peak``:
``memfit.measure``) for plain PyTorch, HF's
``gradient_checkpointing_enable()`` where the model is a HuggingFace one, and memfit
``"memory"`` applied with the example's one line. memfit's first call plans; the two steps after
it are measured, both reported (``first``, ``second``), with the plan's prediction beside them;
gradients are zeroed to None before each measured step, as the frameworks' loops leave them.

Writes ``benchmarks/results/frameworks/frameworks.json`` and ``.md`` naming machine, torch and
date (``--out`` elsewhere; ``--quick``: the HF Trainer and plain-loop rows only, into
``frameworks_quick.*``). Run: ``.venv/bin/python benchmarks/frameworks.py [--quick]`` (about two
minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import memfit
from memfit.bench.environment import load_average, machine_info, software_info
from memfit.bench.runner import Method, measure_peak

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "frameworks"
MiB = 2**20


def _example(name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(
    framework: str,
    make: Callable[[], torch.nn.Module],
    make_memfit: Callable[[], tuple[torch.nn.Module, memfit.CheckpointedModule]],
    step: Callable[[torch.nn.Module], Any],
    hf: Callable[[torch.nn.Module], None] | None,
) -> dict[str, Any]:
    """Peaks of ``step`` for the plain model (``make``), HF gradient checkpointing applied to
    it (``hf``), and memfit (``make_memfit``: what is stepped, and where memfit is applied)."""
    row: dict[str, Any] = {"framework": framework}

    def method(name: str, model: torch.nn.Module, applied: torch.nn.Module | None = None) -> Method:
        """``step`` on ``model`` after one untimed call (for memfit, the one that plans)."""
        m = Method(name, model, lambda: step(model), module=applied, record_failures=False)
        m.run_step()
        return m

    def peak(m: Method) -> int:  # gradients None first, as the frameworks' loops leave them
        return int(measure_peak(m).peak_bytes or 0)

    row["plain"] = peak(method("plain", make()))
    if hf is not None:
        model = make()
        hf(model)
        row["hf_gradient_checkpointing"] = peak(method("HF gradient checkpointing", model))
    model, applied = make_memfit()
    memfit_memory = method('memfit "memory"', model, applied)
    row["memfit_memory_first"] = peak(memfit_memory)
    row["memfit_memory_second"] = peak(memfit_memory)
    row["memfit_predicted"] = applied.memfit.plan.predicted_peak_bytes
    return row


def _hf_gc(model: Any) -> None:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _applied(model: Any) -> tuple[Any, Any]:
    return model, memfit.checkpoint(model)


def _itself(model: Any) -> tuple[Any, Any]:
    """A model memfit was applied to before the framework prepared it."""
    return model, model


def rows(quick: bool = False) -> list[dict[str, Any]]:
    """Every framework's row; ``quick``: HF Trainer's and the plain loop's only."""
    out = []

    hf = _example("hf_trainer")
    data = hf.make_dataset(8)
    batch = {key: torch.stack([row[key] for row in data]) for key in data[0]}
    out.append(  # Trainer.training_step's forward and backward (it needs train()'s state)
        _row(
            "HF Trainer (GPT-2)",
            hf.make_model,
            lambda: _applied(hf.make_model()),
            lambda m: m(**batch).loss.backward(),
            _hf_gc,
        )
    )

    if quick:
        return out + [_plain_loop()]

    peft = _example("peft_lora")
    lora_batch = peft.batch(8)

    def lora_gc(model: Any) -> None:
        _hf_gc(model.get_base_model())
        model.enable_input_require_grads()

    def memfit_before() -> tuple[Any, Any]:
        base = memfit.checkpoint(peft.make_model())
        return peft.lora(base), base

    for order, make_memfit in (
        ("after", lambda: _applied(peft.lora(peft.make_model()))),
        ("before", memfit_before),
    ):
        out.append(
            _row(
                f"peft LoRA, memfit {order} get_peft_model (Llama)",
                lambda: peft.lora(peft.make_model()),
                make_memfit,
                lambda m: m(**lora_batch).loss.backward(),
                lora_gc,
            )
        )

    acc = _example("accelerate_loop")
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    acc_batch = next(iter(acc.make_loader(16, 8)))
    out.append(
        _row(
            "accelerate (Llama)",
            lambda: accelerator.prepare(acc.make_model()),
            lambda: _itself(accelerator.prepare(memfit.checkpoint(acc.make_model()))),
            lambda m: accelerator.backward(m(**acc_batch).loss),
            _hf_gc,
        )
    )

    light = _example("lightning_fit")
    light_batch = torch.cat([next(iter(light.make_loader()))] * 2)

    def lightning_module(keep: bool) -> Any:
        torch.manual_seed(0)
        module = light.LanguageModel()  # the example applies memfit to its net
        if not keep:
            memfit.remove(module.net)
        return module

    out.append(
        _row(
            "Lightning (transformer LM)",
            lambda: lightning_module(False),
            lambda: (lambda m: (m, m.net))(lightning_module(True)),
            lambda m: m.training_step(light_batch, 0).backward(),
            None,
        )
    )

    return out + [_plain_loop()]


def _plain_loop() -> dict[str, Any]:
    loop = _example("plain_loop")
    x, y = loop.batches(1)[0]
    return _row(
        "plain loop (MLP)",
        loop.make_model,
        lambda: _applied(loop.make_model()),
        lambda m: torch.nn.functional.cross_entropy(m(x), y).backward(),
        None,
    )


def markdown(table: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# memfit in each framework: one training step's peak (MiB)",
        "",
        f"{meta['date']}, torch {meta['software']['torch']}, "
        f"{meta['machine'].get('cpu_model')}, {meta['machine'].get('cpu_count')} cores; exact CPU "
        "allocator accounting (`memfit.measure`); written by `benchmarks/frameworks.py`.",
        "",
        '| framework | plain | HF gradient checkpointing | memfit "memory" (1st, 2nd step) '
        "| vs plain | predicted |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in table:
        hf = r.get("hf_gradient_checkpointing")
        predicted = r.get("memfit_predicted")
        lines.append(
            f"| {r['framework']} | {r['plain'] / MiB:.2f} | "
            f"{'-' if hf is None else f'{hf / MiB:.2f}'} | "
            f"{r['memfit_memory_first'] / MiB:.2f}, {r['memfit_memory_second'] / MiB:.2f} | "
            f"{r['memfit_memory_second'] / r['plain']:.2f}x | "
            f"{'-' if predicted is None else f'{predicted / MiB:.2f}'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="HF Trainer and the plain loop only")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    with warnings.catch_warnings(), contextlib.redirect_stdout(None):
        warnings.simplefilter("ignore")
        table = rows(args.quick)
    meta = {
        "date": datetime.date.today().isoformat(),
        "machine": machine_info(),
        "software": software_info(ROOT),
        "load_average": load_average(),
        "quick": args.quick,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / ("frameworks_quick" if args.quick else "frameworks")
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": table}, indent=2))
    text = markdown(table, meta)
    stem.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
