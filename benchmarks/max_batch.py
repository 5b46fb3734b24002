"""The largest batch in plain PyTorch's memory: each method's, and what a sample then costs.

The question (issue 68): in the memory plain PyTorch needs to train at a base batch ``b0``, how
large a batch does each way of saving activation memory train, and at what time per sample? Per
model:

1. **The budget** is plain PyTorch's whole step at ``b0``, measured: parameters and buffers + the
   batch + the step's peak above them (``memfit.measure``, exact allocator accounting on CPU, the
   allocator's counters on CUDA). Optimizer state is left out (the same for every method).
2. **Each method's largest batch**, a multiple of ``step`` rows up to ``limit`` x ``b0``, found
   by doubling then bisection over measured steps (``memfit.execution.largest_batch.
   bisect_largest``): a batch fits when its whole step, measured as the budget was, is within
   the budget; running out of device memory or finding no plan counts as not fitting. Methods:

   * ``plain``: the model as written (its largest batch is ``b0`` or a little more);
   * ``per-block checkpoint``: ``torch.utils.checkpoint`` (non-reentrant) around every block,
     applied by ``apply_activation_checkpointing``; for the HF language model, HF's own
     ``activation_checkpointing_enable()`` (``gradient_checkpointing_enable`` before transformers
     5.24; non-reentrant), which does the same per decoder layer;
   * ``torch.compile budget 0``: ``torch.compile`` under ``torch._functorch.config.
     activation_memory_budget = 0.0``, the min-cut partitioner's lowest setting (recompute all
     it can), compiled afresh at every batch (``--compile-backend``: Inductor by default);
   * ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu`` (pinned on CUDA). On CPU it moves
     nothing (the saved tensors are already on the CPU), so its batch is plain's: recorded as a
     check, not as a result;
   * memfit ``"memory"``: ``memfit.largest_batch(policy="memory")``, the least memory at any
     recomputation;
   * memfit ``budget``: at each batch, the budget left once the weights and the batch are counted
     as a byte budget, ``offload=False`` (recomputation only), probed as ``largest_batch`` probes;
   * memfit ``budget + offload``: ``memfit.largest_batch(policy="auto")``, the same byte budget
     with ``offload=True`` (host memory on CUDA, disk on CPU).

   Each memfit probe is one ``memfit.step`` over the model and its loss (a language model's
   logits and cross-entropy inside the plan), as memfit is used by default.
3. **Time per sample**: every method at ``b0`` and at its largest batch (and, without
   ``--quick``, at the powers of two x ``b0`` between), built afresh, its first steps run, its
   whole step measured again (recorded against the budget), then timed in interleaved rounds
   (``memfit.bench.runner.time_interleaved``, medians), relative to plain at ``b0``.

Models (full run): a deep pre-activation CIFAR ResNet (102 blocks, width 16, ``b0`` 64), a
Llama-like language model (HF ``LlamaForCausalLM``: 12 layers, width 512, vocabulary 32,000,
sequence 1,024, ``b0`` 4), a ViT (12 layers, width 192, 32x32 images in 4x4 patches, ``b0`` 32)
and the ResNet-50-like network of ``benchmarks/offload.py`` (base width 16, ``b0`` 32); batches
searched in steps of ``b0``/4 up to 32 x ``b0``, 7 timing rounds, Inductor for ``torch.compile``.
That is for an idle machine or a GPU: ``--device cuda`` runs the same script there
(``benchmarks/device/max_batch_run.sh``). ``--quick`` (56 minutes on 2 cores at load average 12-18,
2026-12-02): 9 ResNet blocks of width 8, 2 Llama layers of width 64 with a vocabulary of
8,192 and sequence 128, 2 ViT layers of width 64, base width 8; steps of ``b0``/2 up to 8 x
``b0``; 3 rounds; four methods a model (``QUICK_METHODS``); ``torch.compile`` with the
``aot_eager_decomp_partition`` backend (the min-cut partition Inductor's is, under the same
budget, with eager kernels: no C++ compiles, so its memory is Inductor's partition's but its time
is not Inductor's). ``--models`` and ``--methods`` pick fewer.

Writes ``benchmarks/results/max_batch[_quick].json``, ``.md`` and ``.png`` (batch multiple
against time per sample relative to plain at ``b0``, one curve per method, one panel per model),
naming machine, torch and date, rewritten after each model so a run cut short keeps the models
it finished (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import types
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit._compat import activation_memory_budget
from memfit.bench.environment import load_average, report
from memfit.bench.peers import entry_point
from memfit.bench.resnet import PreActBlock, cifar_resnet
from memfit.bench.runner import Method, measure_peak, time_interleaved, warm_up
from memfit.execution.largest_batch import BatchProbe, bisect_largest
from memfit.execution.offload import measure_link
from memfit.measurement.resident import resident_bytes
from memfit.planning.budget import BudgetError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offload import Bottleneck, resnet50_like  # noqa: E402  (the ResNet-50-like network)

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20
PLAIN = "plain"
PER_BLOCK = "per-block checkpoint"
COMPILE = "torch.compile budget 0"
SAVE_ON_CPU = "save_on_cpu"
MEMORY = "memfit memory"
BUDGET = "memfit budget"
OFFLOAD = "memfit budget + offload"
METHODS = (PLAIN, PER_BLOCK, COMPILE, SAVE_ON_CPU, MEMORY, BUDGET, OFFLOAD)
MEMFIT_METHODS = (MEMORY, BUDGET, OFFLOAD)


# ------------------------------------------------------------------------------------ models


class ViT(nn.Module):
    """A ViT: patch embedding, pre-norm encoder layers (``blocks``), mean-pooled linear head."""

    def __init__(
        self, image: int, patch: int, dim: int, depth: int, heads: int, classes: int = 10
    ) -> None:
        super().__init__()
        self.patches = nn.Conv2d(3, dim, patch, patch)
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2, dim) * 0.02)
        self.blocks = nn.Sequential(
            *[
                nn.TransformerEncoderLayer(
                    dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True
                )
                for _ in range(depth)
            ]
        )
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.patches(x).flatten(2).transpose(1, 2) + self.pos
        return self.fc(self.norm(self.blocks(h)).mean(1))


def llama(layers: int, width: int, vocab: int, length: int) -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=width,
        intermediate_size=width * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=max(1, width // 64),
        num_key_value_heads=max(1, width // 128),
        vocab_size=vocab,
        max_position_embeddings=length,
        attn_implementation="sdpa",
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config)


def _image_batch(n: int, device: torch.device, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 3, size, size, generator=g)
    return x.to(device), torch.randint(0, 10, (n,), generator=g).to(device)


def _classify(model: nn.Module, batch: tuple[Any, ...]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _lm_loss(model: nn.Module, batch: tuple[Any, ...]) -> torch.Tensor:
    return model(input_ids=batch[0], labels=batch[0]).loss


@dataclass
class Spec:
    """One model of the benchmark: how to build it and its batches, and its loss."""

    name: str
    describe: str
    make: Callable[[], nn.Module]  # unseeded; ``build`` seeds
    make_batch: Callable[[int, torch.device], tuple[Any, ...]]
    loss: Callable[[nn.Module, tuple[Any, ...]], torch.Tensor]
    #: the block class ``per-block checkpoint`` wraps; None: HF's gradient checkpointing
    block: type | None
    b0: int

    def build(self, device: torch.device) -> nn.Module:
        torch.manual_seed(0)
        return self.make().to(device).train()


#: Model sizes per ``--size``: ResNet blocks per stage and width, the LM's (layers, width,
#: vocabulary, sequence), the ViT's (depth, width, heads), the ResNet-50-like base width, and
#: each model's ``b0``. ``cpu`` is the goal's two models at the least the issue names (102
#: blocks; 12 layers, a 32,000 vocabulary at sequence 512), narrow enough for 2 CPU cores.
SIZES: dict[str, dict[str, Any]] = {
    "quick": dict(res=(3, 8), lm=(2, 64, 8192, 128), vit=(2, 64, 4), r50=8, b0=(8, 2, 16, 4)),
    "cpu": dict(res=(34, 8), lm=(12, 128, 32000, 512), vit=(12, 64, 4), r50=8, b0=(16, 4, 16, 8)),
    "full": dict(
        res=(34, 16), lm=(12, 512, 32000, 1024), vit=(12, 192, 3), r50=16, b0=(64, 4, 32, 32)
    ),
}


def specs(size: str) -> list[Spec]:
    sz = SIZES[size]
    (res, res_w), lm, vit, r50 = sz["res"], sz["lm"], sz["vit"], sz["r50"]
    b_res, b_lm, b_vit, b_r50 = sz["b0"]
    layers, width, vocab, length = lm
    depth, dim, heads = vit

    def tokens(n: int, device: torch.device) -> tuple[torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        return (torch.randint(0, vocab, (n, length), generator=g).to(device),)

    return [
        Spec(
            "deep_resnet",
            f"pre-activation CIFAR ResNet, {3 * res} blocks ({6 * res + 2} layers), width "
            f"{res_w}, 32x32",
            lambda: cifar_resnet(res, width=res_w),
            _image_batch,
            _classify,
            PreActBlock,
            b_res,
        ),
        Spec(
            "llama_lm",
            f"Llama-like LM (HF LlamaForCausalLM), {layers} layers, width {width}, vocabulary "
            f"{vocab:,}, sequence {length}",
            lambda: llama(layers, width, vocab, length),
            tokens,
            _lm_loss,
            None,
            b_lm,
        ),
        Spec(
            "vit",
            f"ViT, {depth} pre-norm layers, width {dim}, {heads} heads, 32x32 in 4x4 patches",
            lambda: ViT(32, 4, dim, depth, heads),
            _image_batch,
            _classify,
            nn.TransformerEncoderLayer,
            b_vit,
        ),
        Spec(
            "resnet50_like",
            f"ResNet-50-like (bottlenecks 3-4-6-3, base width {r50}), 32x32",
            lambda: resnet50_like(base=r50),
            _image_batch,
            _classify,
            Bottleneck,
            b_r50,
        ),
    ]


# ------------------------------------------------------------------------------- the methods


def _tagged(fn: Callable[..., Any], tag: str) -> Callable[..., Any]:
    """``fn`` with a code object of its own, so Dynamo's cache entries of one method's step
    never serve another's (as ``memfit.bench.peers.entry_point`` does for modules)."""
    name = "step_" + "".join(c if c.isalnum() else "_" for c in tag)
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


@dataclass
class Runnable:
    """One method applied to a fresh model: ``run(batch)`` is one forward, loss and backward."""

    model: nn.Module  # the parameters trained
    module: nn.Module | memfit.Step | None  # what a memfit runner settles (its replans)
    run: Callable[[tuple[Any, ...]], None]
    #: the context the first step runs in (torch.compile's budget spans its compilation)
    first: Callable[[], AbstractContextManager[Any]]


def _per_block(spec: Spec, model: nn.Module) -> nn.Module:
    if spec.block is None:
        # transformers 5.24 renamed gradient_checkpointing_enable (deprecated, same behaviour)
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(  # type: ignore[operator]
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        return model
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    block = spec.block
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, block))
    return model


def make_runnable(
    spec: Spec,
    method: str,
    device: torch.device,
    args: argparse.Namespace,
    tag: str,
    room: int | None = None,
) -> Runnable:
    """``method`` on a fresh model; ``room`` is the memfit budget methods' byte budget."""
    model = spec.build(device)
    loss = spec.loss
    if method in (PLAIN, SAVE_ON_CPU):
        pinned = device.type == "cuda"

        def eager(batch: tuple[Any, ...]) -> None:
            ctx = (
                torch.autograd.graph.save_on_cpu(pin_memory=pinned)
                if method == SAVE_ON_CPU
                else nullcontext()
            )
            with ctx:
                loss(model, batch).backward()

        return Runnable(model, None, eager, nullcontext)
    if method == PER_BLOCK:
        wrapped = _per_block(spec, model)
        return Runnable(model, None, lambda b: loss(wrapped, b).backward(), nullcontext)
    if method == COMPILE:
        compiled = torch.compile(entry_point(model, tag), backend=args.compile_backend)
        return Runnable(
            model,
            None,
            lambda b: loss(compiled, b).backward(),  # type: ignore[arg-type]
            lambda: activation_memory_budget(0.0),
        )

    def step_fn(*batch: Any) -> torch.Tensor:
        return loss(model, batch)

    fn = _tagged(step_fn, tag)
    if method == MEMORY:
        stepper = memfit.step(fn, policy="memory")
    else:
        assert room is not None
        stepper = memfit.step(fn, policy=room, offload=method == OFFLOAD)
    return Runnable(model, stepper, lambda b: stepper(*b).backward(), nullcontext)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def probe(
    spec: Spec,
    method: str,
    n: int,
    budget: int,
    weights: int,
    device: torch.device,
    args: argparse.Namespace,
) -> BatchProbe:
    """``method`` at ``n`` rows, as ``memfit.largest_batch`` probes: a first step, then one
    measured; it fits when weights + batch + the measured peak are within ``budget``."""
    torch.compiler.reset()
    batch = spec.make_batch(n, device)
    batch_bytes = sum(t.untyped_storage().nbytes() for t in batch)
    room = budget - weights - batch_bytes
    if room <= 0:
        return BatchProbe(n, False, None, None, f"weights and batch take {weights + batch_bytes:,}")
    run = None
    try:
        run = make_runnable(spec, method, device, args, f"{spec.name}_{method}_{n}", room)
        model, step = run.model, run.run
        with run.first():
            model.zero_grad(set_to_none=True)
            step(batch)
        model.zero_grad(set_to_none=True)
        peak = int(memfit.measure(lambda: step(batch), device=device).peak_bytes or 0)
    except torch.OutOfMemoryError as err:
        return BatchProbe(n, False, None, None, f"out of memory: {str(err).splitlines()[0]}")
    except BudgetError as err:
        return BatchProbe(n, False, None, None, f"no plan fits: {err.least_bytes:,} bytes at least")
    finally:
        del run
        _release(device)
    total = weights + batch_bytes + peak
    return BatchProbe(n, total <= budget, total, peak)


# ------------------------------------------------------------------------------- the search


def search(
    spec: Spec,
    method: str,
    budget: int,
    weights: int,
    device: torch.device,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """``method``'s largest batch within ``budget``: memfit's through ``memfit.largest_batch``
    (``"memory"``; ``"auto"``, a byte budget with offload), the others through the same
    bisection over :func:`probe`."""
    started = time.perf_counter()
    step_rows = max(1, spec.b0 // (2 if args.quick else 4))
    limit = args.limit * spec.b0
    record: dict[str, Any] = {"method": method}

    def show(p: BatchProbe) -> None:
        total = "" if p.total_bytes is None else f"{p.total_bytes / MiB:.1f} MiB"
        print(
            f"  {spec.name} {method}: {p.batch} {'fits' if p.fits else 'over'} {total}"
            f"{'' if p.error is None else ' (' + p.error + ')'}",
            flush=True,
        )

    if method in (MEMORY, OFFLOAD):
        model = spec.build(device)

        def step_fn(*batch: Any) -> torch.Tensor:
            return spec.loss(model, batch)

        found = memfit.largest_batch(
            model,
            lambda n: spec.make_batch(n, device),
            budget,
            step_fn=_tagged(step_fn, f"{spec.name}_{method}_search"),
            policy="memory" if method == MEMORY else "auto",
            start=spec.b0,
            multiple_of=step_rows,
            limit=limit,
            timing_steps=1,
            on_probe=show,
        )
        plan = found.plan
        record.update(
            batch=found.batch,
            first_not_fitting=found.first_not_fitting,
            capped=found.capped,
            probes=[p.__dict__ for p in found.probes],
            plan=None
            if plan is None
            else {
                "predicted_peak_bytes": plan.predicted_peak_bytes,
                "kept_bytes": plan.kept_bytes,
                "offloaded_bytes": plan.offloaded_bytes,
                "offload_to": plan.offload_to,
                "recompute_flops": int(plan.recompute_flops),
                "forward_flops": int(plan.forward_flops),
            },
        )
        del model, found
    else:
        probes: list[BatchProbe] = []

        def fits(n: int) -> bool:
            p = probe(spec, method, n, budget, weights, device, args)
            probes.append(p)
            show(p)
            return p.fits

        batch, first_not, capped = bisect_largest(
            fits, start=spec.b0, multiple_of=step_rows, limit=limit
        )
        record.update(
            batch=batch,
            first_not_fitting=first_not,
            capped=capped,
            probes=[p.__dict__ for p in probes],
        )
    torch.compiler.reset()
    _release(device)
    record["search_s"] = round(time.perf_counter() - started, 1)
    return record


# ------------------------------------------------------------------------------- the timing


def timed_batches(b0: int, largest: int, quick: bool) -> list[int]:
    """The batches a method is timed at: ``b0``, its largest and (full runs) the powers of two
    x ``b0`` between.

    >>> timed_batches(4, 40, False)
    [4, 8, 16, 32, 40]
    >>> timed_batches(4, 40, True)
    [4, 40]
    """
    out = {b0, largest}
    k = 2 * b0
    while not quick and k < largest:
        out.add(k)
        k *= 2
    return sorted(b for b in out if 0 < b <= max(b0, largest))


def time_methods(
    spec: Spec,
    results: list[dict[str, Any]],
    budget: int,
    weights: int,
    device: torch.device,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Every method at its timed batches, built afresh, measured once more, then timed
    interleaved; each point's time per sample relative to plain's at ``b0``."""
    torch.compiler.reset()
    runners: list[tuple[Method, dict[str, Any], int, tuple[Any, ...]]] = []
    for res in results:
        res["points"] = []
        if not res["batch"]:
            continue
        for n in timed_batches(spec.b0, res["batch"], args.size != "full"):
            batch = spec.make_batch(n, device)
            batch_bytes = sum(t.untyped_storage().nbytes() for t in batch)
            tag = f"{spec.name}_{res['method']}_timed_{n}"
            run = make_runnable(
                spec, res["method"], device, args, tag, budget - weights - batch_bytes
            )
            point: dict[str, Any] = {"batch": n, "multiple": n / spec.b0}
            res["points"].append(point)

            def step(run: Runnable = run, batch: tuple[Any, ...] = batch) -> None:
                run.run(batch)

            method = Method(
                f"{res['method']} @ {n}",
                run.model,
                step,
                run.module,
                point,  # type: ignore[arg-type]
            )
            print(f"  {spec.name}: {method.name}: first steps", flush=True)
            with run.first():
                ok = warm_up(method, device)
            if ok:
                try:
                    measure_peak(method, device)
                except (torch.OutOfMemoryError, BudgetError) as err:
                    method.fail("measuring memory", err)
            if not method.failed:
                point["total_bytes"] = weights + batch_bytes + int(point["peak_bytes"] or 0)
                point["within_budget"] = point["total_bytes"] <= budget
                if isinstance(run.module, memfit.Step):
                    plan = run.module.plan
                    point["offloaded_bytes"] = plan.offloaded_bytes
                    point["predicted_peak_bytes"] = plan.predicted_peak_bytes
            runners.append((method, point, n, batch))
    heap = time_interleaved([m for m, _, _, _ in runners], args.rounds, device)
    reference = None
    for method, point, n, _ in runners:
        if not method.failed and point["times_s"]:
            point["step_s"] = statistics.median(point["times_s"])
            point["seconds_per_sample"] = point["step_s"] / n
    for res in results:
        if res["method"] == PLAIN:
            reference = next(
                (p for p in res["points"] if p["batch"] == spec.b0 and "step_s" in p), None
            )
    for res in results:
        for p in res["points"]:
            if reference is not None and "seconds_per_sample" in p:
                p["time_per_sample_vs_plain_b0"] = (
                    p["seconds_per_sample"] / reference["seconds_per_sample"]
                )
        at_largest = next((p for p in res["points"] if p["batch"] == res["batch"]), None)
        res["at_largest"] = at_largest
    del runners
    torch.compiler.reset()
    _release(device)
    return heap


def run_model(spec: Spec, args: argparse.Namespace) -> dict[str, Any]:
    device = args.device
    started = time.perf_counter()
    plain = make_runnable(spec, PLAIN, device, args, f"{spec.name}_budget")
    weights, _ = resident_bytes(plain.model)
    batch = spec.make_batch(spec.b0, device)
    batch_bytes = sum(t.untyped_storage().nbytes() for t in batch)
    plain.model.zero_grad(set_to_none=True)
    plain.run(batch)
    plain.model.zero_grad(set_to_none=True)
    peak = int(memfit.measure(plain.run, batch, device=device).peak_bytes or 0)
    plain.model.zero_grad(set_to_none=True)
    budget = weights + batch_bytes + peak
    parameters = sum(p.numel() for p in plain.model.parameters())
    del plain, batch
    _release(device)
    print(
        f"{spec.name}: {parameters:,} parameters; budget {budget / MiB:.1f} MiB = weights "
        f"{weights / MiB:.1f} + batch {batch_bytes / MiB:.2f} + plain's peak {peak / MiB:.1f} "
        f"at b0={spec.b0}",
        flush=True,
    )
    results = []
    for method in args.methods_for(spec.name):
        try:
            results.append(search(spec, method, budget, weights, device, args))
        except Exception as err:  # noqa: BLE001 - recorded; the other methods go on
            print(f"  {spec.name} {method}: failed: {err!r}", flush=True)
            results.append(
                {
                    "method": method,
                    "batch": 0,
                    "first_not_fitting": None,
                    "capped": False,
                    "probes": [],
                    "search_s": 0.0,
                    "error": f"{type(err).__name__}: {err}"[:2000],
                }
            )
            torch.compiler.reset()
            _release(device)
    for r in results:
        r["multiple"] = r["batch"] / spec.b0
    heap = time_methods(spec, results, budget, weights, device, args)
    return {
        "model": spec.name,
        "describe": spec.describe,
        "parameters": parameters,
        "b0": spec.b0,
        "budget_bytes": budget,
        "weights_bytes": weights,
        "batch_bytes_b0": batch_bytes,
        "plain_peak_b0": peak,
        "results": results,
        "timing_heap": heap,
        "runtime_s": round(time.perf_counter() - started, 1),
    }


# ------------------------------------------------------------------------------- reporting


def markdown(rep: dict[str, Any]) -> str:
    params = rep["parameters"]
    lines = [
        f"# The largest batch in plain PyTorch's memory ({rep['date_utc']}, "
        f"{rep['machine'].get('gpu') or rep['machine'].get('cpu_model', '')}, torch "
        f"{rep['software']['torch']}, device {params['device']})",
        "",
        f"Budget per model: plain PyTorch's whole step at b0 (weights + batch + measured peak). "
        f"Largest batch: a multiple of the search step up to {params['limit']} x b0, measured "
        f"(doubling, then bisection). Time per sample: median of {params['rounds']} interleaved "
        f"rounds, relative to plain at b0. torch.compile backend: {params['compile_backend']}. "
        f"Load average {rep['load_average']['start']} at the start, "
        f"{rep['load_average']['end']} at the end"
        + (
            "; --quick: small models, the machine shared with other jobs, so times are noisy."
            if params["quick"]
            else "."
        ),
        "",
    ]
    if not rep["complete"]:
        lines += ["**Incomplete run**: the models below are those it finished.", ""]
    if params["device"] == "cpu":
        lines += [
            "On CPU `save_on_cpu` moves nothing (the saved tensors are already in host memory): "
            "its row is a check that it matches plain, not a result. memfit's offload goes to "
            f"disk here ({rep['link']['out_bytes_per_s'] / 1e9:.2f} GB/s out, "
            f"{rep['link']['in_bytes_per_s'] / 1e9:.2f} GB/s in, measured).",
            "",
        ]
    for m in rep["models"]:
        lines += [
            f"## {m['model']}: {m['describe']}",
            "",
            f"{m['parameters']:,} parameters; budget {m['budget_bytes'] / MiB:.1f} MiB = "
            f"weights {m['weights_bytes'] / MiB:.1f} + batch {m['batch_bytes_b0'] / MiB:.2f} + "
            f"plain's peak {m['plain_peak_b0'] / MiB:.1f} MiB at b0 = {m['b0']}.",
            "",
            "| method | largest batch | x b0 | next measured | whole step at it | within | "
            "time/sample vs plain@b0 | offloaded | search |",
            "| --- | ---: | ---: | ---: | ---: | :---: | ---: | ---: | ---: |",
        ]
        for r in m["results"]:
            at = r.get("at_largest") or {}
            total = at.get("total_bytes")
            ratio = at.get("time_per_sample_vs_plain_b0")
            nxt = "limit" if r["capped"] else r["first_not_fitting"]
            off = at.get("offloaded_bytes")
            lines.append(
                f"| {r['method']} | {r['batch']} | {r['multiple']:.1f} | {nxt} | "
                f"{'' if total is None else f'{total / MiB:.1f} MiB'} | "
                f"{'' if total is None else ('yes' if at['within_budget'] else '**no**')} | "
                f"{'' if ratio is None else f'{ratio:.2f}x'} | "
                f"{'' if not off else f'{off / MiB:.1f} MiB'} | {r['search_s']:.0f} s |"
            )
        lines.append("")
        over = [
            (r["method"], p["batch"])
            for r in m["results"]
            for p in r["points"]
            if p.get("within_budget") is False
        ]
        failed = [
            (r["method"], p["batch"], str(p.get("error"))[:300])
            for r in m["results"]
            for p in r["points"]
            if "error" in p
        ] + [(r["method"], "search", r["error"]) for r in m["results"] if "error" in r]
        if over:
            lines += [f"Timed points measured over the budget: {over}.", ""]
        if failed:
            lines += [f"Timed points that failed: {failed}.", ""]
    return "\n".join(lines) + "\n"


def figure(rep: dict[str, Any], path: Path) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = rep["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 4), squeeze=False)
    for ax, m in zip(axes[0], models):
        for r in m["results"]:
            pts = [p for p in r["points"] if "time_per_sample_vs_plain_b0" in p]
            if pts:
                ax.plot(
                    [p["multiple"] for p in pts],
                    [p["time_per_sample_vs_plain_b0"] for p in pts],
                    marker="o",
                    color=f"C{METHODS.index(r['method'])}",  # one colour a method in every panel
                    label=r["method"],
                )
        ax.axhline(1.5, color="grey", ls=":", lw=1)
        ax.axvline(10, color="grey", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_title(m["model"], fontsize=10)
        ax.set_xlabel("batch / b0 (within plain's memory at b0)")
        ax.set_ylabel("time per sample / plain's at b0")
    lines = [h for ax in axes[0] for h in ax.get_lines()]
    handles = {str(h.get_label()): h for h in lines if not str(h.get_label()).startswith("_")}
    fig.legend(handles.values(), handles.keys(), fontsize=7, loc="lower center", ncol=len(handles))
    fig.suptitle(
        f"Largest batch in plain PyTorch's memory, {rep['parameters']['device']}, "
        f"{rep['date_utc'][:10]}",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------- the run


QUICK_METHODS = {
    # --quick on 2 loaded cores (a probe takes 10-60 s there): four methods a model, torch.compile
    # where the model is smallest, memfit's budget without offload and save_on_cpu (which moves
    # nothing on CPU) on the deep ResNet only.
    "deep_resnet": (PLAIN, PER_BLOCK, SAVE_ON_CPU, MEMORY, BUDGET, OFFLOAD),
    "llama_lm": (PLAIN, PER_BLOCK, MEMORY, OFFLOAD),
    "vit": (PLAIN, PER_BLOCK, COMPILE, MEMORY),
    "resnet50_like": (PLAIN, PER_BLOCK, MEMORY, OFFLOAD),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small models, fewer methods, 3 rounds")
    p.add_argument(
        "--size",
        choices=sorted(SIZES),
        help="model sizes (SIZES): quick (--quick's), cpu (the goal's models, narrow), full "
        "(default)",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--models", help="comma-separated: deep_resnet,llama_lm,vit,resnet50_like")
    p.add_argument("--methods", help="comma-separated, of: " + ", ".join(METHODS))
    p.add_argument("--rounds", type=int, help="interleaved timing rounds; default 7, --quick 3")
    p.add_argument("--limit", type=int, help="largest batch searched, x b0; default 32, --quick 8")
    p.add_argument(
        "--compile-backend",
        help="torch.compile's backend; default inductor, --quick aot_eager_decomp_partition "
        "(the same min-cut partition under the same budget, eager kernels: no C++ compile)",
    )
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    args.size = args.size or ("quick" if args.quick else "full")
    args.rounds = args.rounds or (3 if args.quick else 7)
    args.limit = args.limit or (8 if args.quick else 32)
    args.compile_backend = args.compile_backend or (
        "aot_eager_decomp_partition" if args.quick else "inductor"
    )
    args.device = torch.device(args.device)
    chosen = None if args.methods is None else [m.strip() for m in args.methods.split(",")]
    unknown = set(chosen or ()) - set(METHODS)
    if unknown:
        p.error(f"unknown methods {sorted(unknown)}; known: {list(METHODS)}")

    def methods_for(model: str) -> tuple[str, ...]:
        if chosen is not None:
            return tuple(m for m in METHODS if m in chosen)
        return QUICK_METHODS[model] if args.quick else METHODS

    args.methods_for = methods_for
    return args


def write(
    stem: Path,
    args: argparse.Namespace,
    started: float,
    load_start: list[float] | None,
    models: list[dict[str, Any]],
    link: Any,
    complete: bool,
) -> dict[str, Any]:
    """The report so far, rewritten after each model (``.json``, ``.md``, ``.png``), so a run cut
    short (a device call's time limit) still leaves the models it finished."""
    rep = report(
        "max_batch",
        ROOT,
        started,
        load_start,
        models,
        parameters={
            "device": str(args.device),
            "quick": args.quick,
            "size": args.size,
            "rounds": args.rounds,
            "limit": args.limit,
            "compile_backend": args.compile_backend,
            "budget": "plain's whole step at b0: parameters and buffers + batch + measured peak",
            "fits": "a method's whole step at the batch, measured alike, within the budget",
        },
        complete=complete,
        link={
            "to": "host" if args.device.type == "cuda" else "disk",
            "out_bytes_per_s": link.out_bytes_per_s,
            "in_bytes_per_s": link.in_bytes_per_s,
        },
    )
    if args.device.type == "cuda":
        rep["machine"]["gpu"] = torch.cuda.get_device_name(args.device)
    stem.with_suffix(".json").write_text(json.dumps(rep, indent=2, default=str) + "\n")
    stem.with_suffix(".md").write_text(markdown(rep))
    figure(rep, stem.with_suffix(".png"))
    return rep


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / ("max_batch" + ("" if args.size == "full" else "_" + args.size))
    started, load_start = time.perf_counter(), load_average()
    print(f"max_batch on {args.device}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}")
    link = measure_link("host" if args.device.type == "cuda" else "disk", args.device)
    chosen = None if args.models is None else set(args.models.split(","))
    models: list[dict[str, Any]] = []
    for spec in specs(args.size):
        if chosen is None or spec.name in chosen:
            models.append(run_model(spec, args))
            write(stem, args, started, load_start, models, link, complete=False)
    rep = write(stem, args, started, load_start, models, link, complete=True)
    print(markdown(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
