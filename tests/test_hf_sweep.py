"""Every tiny HuggingFace architecture of ``memfit.bench.hf_tiny`` trains under memfit as under
plain PyTorch (losses and gradients), at the peak memfit predicted (5% above, 2% below at most),
``"memory"`` at or below HF's gradient checkpointing and ``"none"`` at or below plain.

One case per architecture, each in its own process (``hf_sweep.run_isolated``: Dynamo's caches
are per process, and one architecture's crash must not end the others), at the benchmark's
shape (batch 2 x 64, fp32) with no timed steps, so ``benchmarks/results/hf_sweep.md`` is what
these cases see. A criterion a row misses for a known reason is in :data:`KNOWN` alone: the
case raises :class:`KnownMiss` for it, which the case's strict ``xfail`` expects, and any other
miss fails it; when the fix lands the case passes and the strict ``xfail`` fails, so the row
leaves the table.

Cost: a case took 30-35 s of CPU on the loaded 2-core machine (GPT-2 29.7 s, Mixtral 34.5 s;
importing torch, transformers and memfit is 6 of them, capturing and planning twice most of the
rest; Mamba's unrolled scan 87 s), so every architecture would take about half an hour of the
slow tier. ``make test`` runs :data:`TIER`, twelve architectures (about 480 s of CPU measured,
about four minutes on two cores); ``MEMFIT_HF_SWEEP=all`` runs every one, as the benchmark
does, and its misses outside :data:`KNOWN` are unmeasured until the benchmark's full pass.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from memfit.bench import hf_sweep, hf_tiny  # noqa: E402

pytestmark = pytest.mark.slow

#: Seconds one architecture may take in its process (a loaded 2-core machine took up to 3 min).
TIMEOUT = 900

#: The architectures ``make test`` runs: those whose rows ``benchmarks/results/hf_sweep.json``
#: holds (so :data:`KNOWN` is measured, not guessed): one or more of every family.
TIER = frozenset(
    "gpt2 llama gpt_neo mixtral qwen2_moe mamba mamba2 bert t5 vit wav2vec2 clip".split()
)
EVERY = os.environ.get("MEMFIT_HF_SWEEP") == "all"

#: (architecture, criterion) pairs missed today, and why. Each is the only criterion its case
#: forgives; see the module docstring.
KNOWN: dict[tuple[str, str], str] = {
    ("wavlm", "prediction"): '"memory" predicted 7.5% over its measured peak (949,848 B against '
    '883,486), "none" 6.3% over: its encoder graph outputs a 127,008 B position bias the step '
    "does not hold as predicted, and its last (log-softmax) graph's output, also saved, is "
    "counted twice",
    ("sew", "prediction"): '"none" predicted 11% over its measured peak (670,622 B against '
    "604,446), across SpecAugment's graph breaks, as WavLM's",
    ("sew", "memory_le_hf_gc"): '"memory" 456,836 B against HF checkpointing\'s 421,954: values '
    "crossing its graph breaks are kept",
}


class KnownMiss(AssertionError):
    """A criterion :data:`KNOWN` lists was missed, as expected."""


def _explain(row: dict[str, Any], criterion: str) -> str:
    m = row["methods"]
    plain, gc, mem, none = (m[k] for k in hf_sweep.METHODS)
    if criterion == "exact":
        return "; ".join(
            f"{k}: loss {m[k].get('loss_rel')}, gradients {m[k].get('grad_rel')}"
            for k in ("memory", "none")
        )
    if criterion == "prediction":
        return "; ".join(
            f"{k}: predicted {m[k].get('predicted_bytes')} B, measured {m[k].get('peak_bytes')} B"
            for k in ("memory", "none")
        )
    if criterion == "memory_le_hf_gc":
        ref = gc if "peak_bytes" in gc else plain
        return f"memory {mem.get('peak_bytes')} B, HF checkpointing {ref.get('peak_bytes')} B"
    return f"none {none.get('peak_bytes')} B, plain {plain.get('peak_bytes')} B"


def _cases() -> list[Any]:
    cases = []
    for name in hf_tiny.ARCHITECTURES:
        known = sorted(c for (n, c) in KNOWN if n == name)
        marks: list[Any] = []
        if not EVERY and name not in TIER:
            marks.append(pytest.mark.skip(reason="outside TIER: MEMFIT_HF_SWEEP=all runs it"))
        if known:
            reason = "; ".join(f"{c}: {KNOWN[(name, c)]}" for c in known)
            marks.append(pytest.mark.xfail(raises=KnownMiss, strict=True, reason=reason))
        cases.append(pytest.param(name, marks=marks, id=name))
    return cases


@pytest.mark.parametrize("name", _cases())
def test_architecture_meets_the_four_criteria(name: str) -> None:
    threads = max(1, torch.get_num_threads())
    row = hf_sweep.run_isolated(name, timeout=TIMEOUT, timed=0, threads=threads)
    assert "error" not in row and "build_error" not in row, row.get("error") or row["build_error"]
    failed = {method: rec["error"] for method, rec in row["methods"].items() if "error" in rec}
    assert not failed, failed
    missed = [c for c, ok in row["criteria"].items() if not ok]
    unknown = [c for c in missed if (name, c) not in KNOWN]
    assert not unknown, {c: _explain(row, c) for c in unknown}
    known = sorted(c for (n, c) in KNOWN if n == name)
    fixed = [c for c in known if c not in missed]
    assert not fixed, f"{name} meets {fixed} now: remove it from KNOWN"
    if missed:
        raise KnownMiss({c: _explain(row, c) for c in missed})
