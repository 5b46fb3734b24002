"""Which saved values to offload: Meng et al.'s ``"swap"``, and offload points on the frontier.

Offloading a saved value is a third answer besides keeping and recomputing it; its price is time
the compute waits for the link (``analysis.transfers``), not FLOPs. Two questions are answered here.

``"swap"`` (Meng et al. 2017): recompute nothing; offload, in forward order, every value whose
copies hide behind compute. The longest forward-order prefix whose predicted stall stays within
``tolerance`` of the step's compute is found by bisection (the stall grows with the prefix: each
added copy only queues behind the earlier ones), then the values after it are tried one by one
(at most ``max_extra``), so a large late value that cannot hide does not stop smaller ones after
it.

With a budget (``offload=True``): from every recompute-only point of the frontier, offloading its
largest saved values first (prefixes of 1, 2, 4, ... values, and the swap prefix) gives plans with
less memory for stall time; their cost is recompute seconds plus stall seconds, and they join the
frontier, which the budget answers as before: the cheapest plan that fits. Offload thereby extends
the frontier below the least peak recomputation alone reaches.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch.fx as fx

from memfit.analysis.graph import JointGraph
from memfit.analysis.simulate import StepSimulation, simulate_step
from memfit.analysis.transfers import (
    Link,
    TransferSchedule,
    offloadable,
    schedule_transfers,
    value_bytes,
)
from memfit.planning.frontier import (
    MIN_GAP,
    SEARCH_SAFETY_LIMIT_S,
    Candidate,
    pareto,
    warn_cut,
)

__all__ = ["MIN_OFFLOAD_BYTES", "OffloadCandidate", "offload_variants", "swap", "with_offload"]

#: Values smaller than this are not offloaded by default: four ops and a file per value cost
#: more than the bytes they would free.
MIN_OFFLOAD_BYTES = 64 * 1024


@dataclass(frozen=True)
class OffloadCandidate:
    """One simulated plan with offload: what it keeps on the device, what moves, and its peak."""

    kept: frozenset[fx.Node]
    schedule: TransferSchedule
    simulation: StepSimulation


def _schedule(
    jg: JointGraph, sim: StepSimulation, values: Sequence[fx.Node], link: Link, seconds: dict
) -> TransferSchedule:
    return schedule_transfers(jg, sim.forward, sim.backward, values, link, seconds)


def swap(
    jg: JointGraph,
    kept: set[fx.Node],
    sim: StepSimulation,
    link: Link,
    seconds: dict[fx.Node, float],
    *,
    tolerance: float = 0.01,
    max_extra: int = 32,
    min_bytes: int = MIN_OFFLOAD_BYTES,
    limit_bytes: int | None = None,
) -> OffloadCandidate:
    """Offload what hides behind compute from the plan keeping ``kept`` (simulated as ``sim``),
    at most ``limit_bytes`` in all."""
    candidates = offloadable(jg, jg.saved_needed(kept), min_bytes=min_bytes)
    allowed = tolerance * max(_schedule(jg, sim, [], link, seconds).compute_seconds, 1e-12)

    def hidden(values: Sequence[fx.Node]) -> bool:
        if limit_bytes is not None and _bytes(jg, values) > limit_bytes:
            return False
        return _schedule(jg, sim, values, link, seconds).stall_seconds <= allowed

    lo, hi = 0, len(candidates)  # the longest hidden prefix: candidates[:lo]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if hidden(candidates[:mid]):
            lo = mid
        else:
            hi = mid - 1
    chosen = list(candidates[:lo])
    for value in candidates[lo + 1 : lo + 1 + max_extra]:
        if hidden([*chosen, value]):
            chosen.append(value)
    schedule = _schedule(jg, sim, chosen, link, seconds)
    return OffloadCandidate(
        frozenset(kept), schedule, simulate_step(jg, kept, transfers=schedule.transfers)
    )


def _bytes(jg: JointGraph, values: Sequence[fx.Node]) -> int:
    return sum(value_bytes(jg, v) for v in values)


def offload_variants(
    jg: JointGraph,
    point: Candidate,
    link: Link,
    seconds: dict[fx.Node, float],
    *,
    deadline: float | None = None,
    min_bytes: int = MIN_OFFLOAD_BYTES,
    limit_bytes: int | None = None,
) -> list[Candidate]:
    """The frontier ``point`` with some of its saved values offloaded, largest first, and as
    the swap plan; none offloads more than ``limit_bytes``. Each recomputes what ``point`` does
    and adds the time compute waits for the link."""
    kept, sim = set(point.kept), point.simulation
    candidates = offloadable(jg, jg.saved_needed(kept), min_bytes=min_bytes)
    if not candidates:
        return []
    by_size = sorted(candidates, key=lambda n: -value_bytes(jg, n))
    if limit_bytes is not None:  # the largest values that fit the limit together
        fitting, total = [], 0
        for n in by_size:
            size = value_bytes(jg, n)
            if total + size <= limit_bytes:
                fitting.append(n)
                total += size
        by_size = fitting
    if not by_size:
        return []
    counts = []
    k = 1
    while k < len(by_size):
        counts.append(k)
        k *= 2
    counts.append(len(by_size))
    found = [swap(jg, kept, sim, link, seconds, min_bytes=min_bytes, limit_bytes=limit_bytes)]
    for count in counts:
        if deadline is not None and time.perf_counter() > deadline:
            break
        schedule = _schedule(jg, sim, by_size[:count], link, seconds)
        found.append(
            OffloadCandidate(
                frozenset(kept), schedule, simulate_step(jg, kept, transfers=schedule.transfers)
            )
        )
    return [
        dataclasses.replace(
            point,
            peak_bytes=c.simulation.peak_bytes,
            source=f"{point.source}+offload",
            simulation=c.simulation,
            schedule=c.schedule,
        )
        for c in found
        if c.schedule.transfers
    ]


def with_offload(
    jg: JointGraph,
    points: list[Candidate],
    link: Link,
    seconds: dict[fx.Node, float],
    *,
    min_gap: float = MIN_GAP,
    time_limit_s: float = SEARCH_SAFETY_LIMIT_S,
    min_bytes: int = MIN_OFFLOAD_BYTES,
    limit_bytes: int | None = None,
) -> list[Candidate]:
    """The frontier ``points`` extended with offload plans of each of them, Pareto-filtered."""
    deadline = time.perf_counter() + time_limit_s
    extended = list(points)
    cut = False  # whether the safety net stopped counted work
    for p in points:
        if time.perf_counter() > deadline:
            cut = True
            break
        extended += offload_variants(
            jg, p, link, seconds, deadline=deadline, min_bytes=min_bytes, limit_bytes=limit_bytes
        )
        cut = cut or time.perf_counter() > deadline  # the variants stop at the deadline
    if cut:  # a safety net: the variants are counted work
        warn_cut(jg, f"its {time_limit_s:g} s limit for offload plans")
    baseline = max(p.peak_bytes for p in points)
    return pareto(extended, min_gap * baseline)
