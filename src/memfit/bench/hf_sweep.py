"""One row of the HuggingFace sweep: a tiny architecture trained four ways, measured and checked.

Why: a user brings whichever architecture they train, and memfit must either serve it (the same
losses and gradients as plain PyTorch, a peak it predicted, no more memory than the ways they
have without it) or say why not. :func:`run_row` trains one architecture of
:mod:`memfit.bench.hf_tiny` as ``Trainer`` does (loss inside the model, the output dropped
before the backward, ``.grad`` None before each step as ``optimizer.zero_grad()`` leaves it,
fp32 on CPU) four ways: plain PyTorch, HF's ``gradient_checkpointing_enable()``
(non-reentrant), memfit ``"memory"`` and memfit ``"none"``. Each way runs its first step and
memfit's settling (``bench.runner.first_step``), then one step whose loss and gradients are
compared with plain's (the same seed before each, so dropout draws alike), one step under
``memfit.measure`` (exact CPU allocator accounting) and ``timed`` timed steps (median kept).

The row carries the four criteria (:data:`CRITERIA`) and, where a way failed, the phase and the
error: an architecture memfit cannot serve is in the table with its reason, never left out.
Every row runs in its own process (:func:`run_isolated`, ``python -m memfit.bench.hf_sweep
NAME``): Dynamo's caches and recompile limits are per process, and a crash, a hang or a leak
in one architecture must not touch the next.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
import warnings
from typing import Any

import numpy
import torch

import memfit
from memfit.bench import hf_tiny
from memfit.bench.runner import Method, first_step

__all__ = [
    "CRITERIA",
    "METHODS",
    "criteria",
    "run_isolated",
    "run_row",
]

#: The four ways each architecture is trained.
METHODS = ("plain", "hf_gc", "memory", "none")
#: What a row must meet: memfit's losses and gradients equal plain's; each memfit peak
#: predicted within 5% above and 2% below; ``"memory"`` at or below HF's checkpointing (plain's
#: where the architecture has none); ``"none"`` at or below plain.
CRITERIA = ("exact", "prediction", "memory_le_hf_gc", "none_le_plain")
#: Predicted over measured peak: at most this much above ...
OVER = 0.05
#: ... and this much below.
UNDER = 0.02
#: Loss: relative difference allowed; gradients: largest difference over the largest gradient.
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4
#: Seed set before every step (torch, numpy, random), so each way draws the same masks.
STEP_SEED = 7
#: What the row's JSON line starts with on the child's stdout.
MARK = "HF_SWEEP_ROW "


def _apply(method: str, model: torch.nn.Module) -> str | None:
    """Set ``method`` up on ``model``; a reason when the architecture does not offer it."""
    if method == "hf_gc":
        if not getattr(model, "supports_gradient_checkpointing", False):
            return f"{type(model).__name__} does not support gradient checkpointing"
        model.gradient_checkpointing_enable(  # type: ignore[operator]
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )
    elif method in ("memory", "none"):
        memfit.checkpoint(model, method)
    return None


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _exactness(
    loss: float, grads: dict[str, torch.Tensor], ref_loss: float, ref: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """How far a step's loss and gradients are from plain's, relative to plain's."""
    out: dict[str, Any] = {"loss_rel": abs(loss - ref_loss) / max(abs(ref_loss), 1e-12)}
    if set(grads) != set(ref):
        out["grad_names_differ"] = sorted(set(grads) ^ set(ref))[:5]
        out["grad_rel"] = float("inf")
        return out
    scale = max((float(r.abs().max()) for r in ref.values()), default=0.0) or 1.0
    worst = max((float((grads[n] - r).abs().max()) for n, r in ref.items()), default=0.0)
    out["grad_rel"] = worst / scale
    return out


def _run_method(
    name: str, method: str, batch: int, length: int, timed: int, ref: dict[str, Any] | None
) -> dict[str, Any]:
    """One way of training the architecture: its first step, exactness, peak and step time."""
    model = hf_tiny.build(name)
    inputs = hf_tiny.make_inputs(name, model, batch, length)
    rec: dict[str, Any] = {}
    reason = _apply(method, model)
    if reason is not None:
        rec["unsupported"] = reason
        return rec
    losses: list[float] = []

    def step() -> None:
        # numpy too: wav2vec2-like models draw SpecAugment's masks with numpy in training
        random.seed(STEP_SEED)
        numpy.random.seed(STEP_SEED)
        torch.manual_seed(STEP_SEED)
        loss = model(**inputs).loss  # the output dropped before backward, as Trainer does
        losses.append(float(loss.detach()))
        loss.backward()

    runner = Method(f"{name} {method}", model, step, record_failures=False)
    phase = "first step"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rec["first_step_s"] = first_step(runner)
        memfit_warnings = {
            f"{w.category.__name__}: {w.message}"
            for w in caught
            if "memfit" in str(w.filename) or "memfit" in str(w.message)
        }
        if memfit_warnings:
            rec["warnings"] = sorted(memfit_warnings)[:5]
        phase = "exactness step"
        runner.zero_grad()
        losses.clear()
        step()
        rec["loss"] = losses[-1]
        grads = _grads(model)
        if ref is not None:
            rec.update(_exactness(losses[-1], grads, ref["loss"], ref["grads"]))
        else:
            rec["grads"] = grads
        phase = "measuring memory"
        runner.zero_grad()
        rec["peak_bytes"] = int(memfit.measure(step).peak_bytes or 0)
        if isinstance(model, memfit.CheckpointedModule):
            plan = model.memfit.plan
            rec["predicted_bytes"] = int(plan.predicted_peak_bytes)
            rec["graphs"] = len(plan.graphs)
            rec["recomputed"] = bool(plan.recomputed)
        phase = "timing"
        times = []
        for _ in range(timed):
            runner.zero_grad()
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        rec["step_s"] = statistics.median(times) if times else None
    except Exception as err:  # noqa: BLE001 - the row records why this way failed
        rec["error"] = f"{phase}: {type(err).__name__}: {str(err)[:400]}"
    return rec


def criteria(row: dict[str, Any]) -> dict[str, bool | None]:
    """The row's four criteria (:data:`CRITERIA`): True, False, or None where a way it needs
    did not run."""
    m = row.get("methods", {})
    plain, gc, mem, none = (m.get(k, {}) for k in METHODS)
    out: dict[str, bool | None] = dict.fromkeys(CRITERIA)
    served = [r for r in (mem, none) if "peak_bytes" in r]
    if "peak_bytes" not in plain or len(served) < 2:
        if "peak_bytes" in plain and (mem or none):
            out.update(dict.fromkeys(CRITERIA, False))  # memfit failed where plain ran
        return out
    out["exact"] = all(
        r.get("loss_rel", 1.0) <= LOSS_RTOL and r.get("grad_rel", 1.0) <= GRAD_RTOL for r in served
    )
    out["prediction"] = all(
        (1 - UNDER) * r["peak_bytes"] <= r["predicted_bytes"] <= (1 + OVER) * r["peak_bytes"]
        for r in served
    )
    reference = gc if "peak_bytes" in gc else plain
    out["memory_le_hf_gc"] = mem["peak_bytes"] <= reference["peak_bytes"]
    out["none_le_plain"] = none["peak_bytes"] <= plain["peak_bytes"]
    return out


def run_row(name: str, batch: int = 2, length: int = 64, timed: int = 3) -> dict[str, Any]:
    """Train ``name`` the four ways (:data:`METHODS`) in this process and return its row:
    architecture, family, task, parameter count, each way's record and the criteria."""
    arch = hf_tiny.ARCHITECTURES[name]
    row: dict[str, Any] = {"name": name, "family": arch.family, "task": arch.task}
    t0 = time.perf_counter()
    try:
        model = hf_tiny.build(name)
        row["model_class"] = type(model).__name__
        row["parameters"] = sum(p.numel() for p in model.parameters())
        del model
    except Exception as err:  # noqa: BLE001 - the row says why it did not build
        row["build_error"] = f"{type(err).__name__}: {str(err)[:400]}"
        return row
    methods: dict[str, dict[str, Any]] = {}
    ref: dict[str, Any] | None = None
    for method in METHODS:
        rec = _run_method(name, method, batch, length, timed, ref)
        if method == "plain":
            if "error" in rec:
                row["methods"] = {"plain": rec}
                row["build_error"] = f"plain PyTorch failed: {rec['error']}"
                return row
            ref = {"loss": rec["loss"], "grads": rec.pop("grads")}
        methods[method] = rec
    row["methods"] = methods
    row["criteria"] = criteria(row)
    row["row_s"] = time.perf_counter() - t0
    return row


def run_isolated(
    name: str,
    timeout: float = 600.0,
    batch: int = 2,
    length: int = 64,
    timed: int = 3,
    threads: int | None = None,
) -> dict[str, Any]:
    """:func:`run_row` in a fresh Python process (this interpreter, this ``sys.path``); a row
    with ``"error"`` when it crashed or ran past ``timeout`` seconds. ``cpu_s`` is the child's
    CPU time (user + system), what the row costs a machine whatever else runs on it."""
    cmd = [sys.executable, "-m", "memfit.bench.hf_sweep", name]
    cmd += ["--batch", str(batch), "--length", str(length), "--timed", str(timed)]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    before = os.times()
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        arch = hf_tiny.ARCHITECTURES[name]
        return {
            "name": name,
            "family": arch.family,
            "task": arch.task,
            "error": f"timed out after {timeout:.0f} s",
            "wall_s": time.perf_counter() - t0,
        }
    after = os.times()
    cpu = (after.children_user - before.children_user) + (
        after.children_system - before.children_system
    )
    for line in done.stdout.splitlines():
        if line.startswith(MARK):
            row: dict[str, Any] = json.loads(line[len(MARK) :])
            break
    else:
        arch = hf_tiny.ARCHITECTURES[name]
        row = {
            "name": name,
            "family": arch.family,
            "task": arch.task,
            "error": f"process exited {done.returncode}: {done.stderr[-1500:]}",
        }
    row["wall_s"] = time.perf_counter() - t0
    row["cpu_s"] = cpu
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="One row of the HuggingFace sweep, as JSON.")
    parser.add_argument("name", choices=sorted(hf_tiny.ARCHITECTURES))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--timed", type=int, default=3)
    parser.add_argument("--threads", type=int)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    row = run_row(args.name, args.batch, args.length, args.timed)
    print(MARK + json.dumps(row, default=float), flush=True)


if __name__ == "__main__":
    main()
