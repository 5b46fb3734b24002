"""The rich tables the command line prints: per policy, per submodule, per tensor, per budget."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.table import Table

from memfit.cli.batch_search import SearchResult
from memfit.cli.steps import PolicyResult
from memfit.measurement.activations import LOSS, Activations
from memfit.units import format_bytes

__all__ = ["mib", "duration", "policy_table", "module_table", "tensor_table", "batch_table"]

MIB = 2**20


def mib(n: float) -> str:
    """Bytes in MiB with one decimal; KiB or B below a tenth of a MiB."""
    if abs(n) >= 0.1 * MIB:
        return f"{n / MIB:.1f} MiB"
    return f"{n / 1024:.1f} KiB" if abs(n) >= 1024 else f"{n:.0f} B"


def duration(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s < 10 else f"{s:.1f} s"


def _table(title: str, columns: Sequence[tuple[str, str]]) -> Table:
    table = Table(title=title)
    for name, justify in columns:
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    return table


def policy_table(
    results: Sequence[PolicyResult], title: str, plain_peak_bytes: int | None = None
) -> Table:
    """Measured peak and step time per policy, each also as a ratio to ``none``; with
    ``plain_peak_bytes`` (plain PyTorch's step, measured), a first row for it and the peaks as a
    ratio to it too: the savings a user gets, with memfit's ``none`` beside them."""
    base = next((r for r in results if r.label == "none"), results[0])
    offloads = any(r.plan.offloaded for r in results)
    plain = plain_peak_bytes or None
    columns = [
        ("policy", "left"),
        ("measured peak", "right"),
        *([("vs plain", "right")] if plain else []),
        ("vs none", "right"),
        ("predicted peak", "right"),
        ("step time", "right"),
        ("vs none", "right"),
        ("recomputed", "right"),
    ]
    if offloads:  # where to is one place per run: the header says it
        to = next(r.plan.offload_to for r in results if r.plan.offloaded)
        columns.append((f"offloaded ({to})", "right"))
    table = _table(title, [*columns, ("first step", "right")])

    def vs(peak: int, of: int | None) -> str:
        return f"{peak / of:.2f}x" if of else "-"

    if plain:
        cells = ["plain PyTorch", mib(plain), "1.00x", vs(plain, base.peak_bytes)]
        cells += ["-"] * (len(columns) - len(cells))
        table.add_row(*cells, "-")
    for r in results:
        cells = [
            r.label,
            mib(r.peak_bytes),
            *([vs(r.peak_bytes, plain)] if plain else []),
            vs(r.peak_bytes, base.peak_bytes),
            mib(r.predicted_peak_bytes),
            duration(r.step_time),
            f"{r.step_time / base.step_time:.2f}x" if base.step_time else "-",
            f"{r.recompute_fraction:.0%} of fwd",
        ]
        if offloads:
            plan = r.plan
            cells.append(mib(plan.offloaded_bytes) if plan.offloaded else "-")
        table.add_row(*cells, f"{r.compile_s:.1f} s")
    return table


def module_table(acts: Activations, model_name: str, top: int = 10) -> Table:
    """Submodules whose own code produced the most saved bytes."""
    table = _table(
        f"activation memory by submodule (top {top} of {len(acts.modules)})",
        [
            ("submodule", "left"),
            ("type", "left"),
            ("own", "right"),
            ("with children", "right"),
            ("share", "right"),
            ("tensors", "right"),
        ],
    )
    for m in acts.modules[:top]:
        name = m.module or f"({model_name} itself)"
        share = m.self_bytes / acts.total_bytes if acts.total_bytes else 0.0
        table.add_row(
            name,
            m.type if m.module != LOSS else "",
            mib(m.self_bytes),
            mib(m.total_bytes),
            f"{share:.0%}",
            str(m.tensors),
        )
    return table


def tensor_table(acts: Activations, model_name: str, top: int = 10) -> Table:
    """The largest storages kept for backward."""
    table = _table(
        f"largest tensors kept for backward (top {top} of {len(acts.tensors)})",
        [
            ("size", "right"),
            ("shape", "left"),
            ("dtype", "left"),
            ("made by", "left"),
            ("read by", "left"),
        ],
    )
    for t in acts.tensors[:top]:
        table.add_row(
            mib(t.bytes),
            "x".join(map(str, t.shape)) or "scalar",
            t.dtype,
            t.module or f"({model_name} itself)",
            ", ".join(t.saved_by),
        )
    return table


def batch_table(searches: Sequence[SearchResult], budget_text: str) -> Table:
    """Largest batch per policy within the budget, and the measured batch just above it."""
    table = _table(
        f"largest batch within {budget_text} (weights + batch + measured step peak)",
        [
            ("policy", "left"),
            ("max batch", "right"),
            ("memory at it", "right"),
            ("first batch over", "right"),
            ("memory there", "right"),
            ("steps measured", "right"),
        ],
    )
    for s in searches:
        over: Any = next((p for p in s.probes if p.batch == s.first_not_fitting), None)
        table.add_row(
            s.label,
            (f">= {s.max_batch} (limit)" if s.capped else str(s.max_batch)),
            format_bytes(s.total_bytes) if s.total_bytes is not None else "-",
            str(s.first_not_fitting) if s.first_not_fitting is not None else "-",
            (
                format_bytes(over.total_bytes)
                if over is not None and over.total_bytes is not None
                else (over.error or "").split(":")[0]
                if over is not None
                else "-"
            ),
            str(len(s.probes)),
        )
    return table
