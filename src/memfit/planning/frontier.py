"""The (peak memory, recompute time) Pareto frontier of one joint graph, and choosing from it.

Why a frontier rather than one solve per budget: the answer to "the cheapest plan within B" must
be *monotonic* — a smaller budget must never give a larger peak — and its peak must be the one the
simulator predicts, not the segment model's estimate. Both follow if every budget is answered from
one set of simulated plans: the frontier, sorted by peak, has decreasing cost; the cheapest point
within B is the one with the largest peak ≤ B, and it moves down as B does.

The frontier's points come from plain autograd, ``"speed"``, the cut heuristic
(``policies.keep_min_peak``), per-block checkpointing read from the module structure
(``policies.keep_blocks``: what users write by hand), the segment programme of
``planning.segments`` solved at a grid of modelled budgets between its least feasible peak and
keeping everything (each solve is a few milliseconds; the simulator replays every distinct plan),
and a local search in the simulator from the least peak among them (``planning.refine``). Under
Inductor (``jg.fused_elementwise``) each of those plans also comes with fusible recomputation
added, and ``torch.compile``'s own plans at a grid of ``activation_memory_budget`` values join them
(``planning.fusion``), so the frontier holds every plan ``torch.compile`` would pick. Points closer
than ``min_gap`` of the baseline peak to a cheaper point are dropped, so two plans the measurement
could not tell apart never both appear; the least peak is always kept.

``"memory"`` and the budget plan. ``"memory"`` is the frontier's lowest point, so a budget equal
to its peak returns ``"memory"`` itself, and no budget plan peaks lower. Under Inductor, where
the simulation only estimates what runs, ``"memory"`` is the cheapest point within ``MIN_GAP`` of
the lowest (``least_peak_point``), and a budget at its peak still returns it. Both obey the same
at-most-one-recomputation rule: every plan here is a set of kept values, and the executor
recomputes each forward op at most once for any kept set.

Work is counted, not timed: the bisection (10 solves), the grid (``grid`` solves), the local
search (a number of simulations set by the graph's size) and the Inductor candidates (one per
frontier plan and one per ``COMPILE_BUDGETS`` value) are fixed amounts, so the plan for a graph
is the same on a busy machine as on an idle one. (It was not: the Inductor candidates once
stopped at 20 s, which they take 10 s to reach on an idle 2-core machine for a 1,700-node ResNet,
so a loaded machine got other plans.) Time limits remain as safety nets only: ``time_limit_s``
(``SEARCH_SAFETY_LIMIT_S``) for the search, ``FUSED_SAFETY_LIMIT_S`` for the Inductor
candidates. If one is reached the frontier holds the points found so far, which always include
plain autograd, ``"speed"`` and the cut heuristic, so every budget is still answered within its
bytes or refused, and memfit warns that this plan depends on the machine's speed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch.fx as fx

from memfit.analysis.cost import keeping_seconds, node_flops, node_seconds
from memfit.analysis.graph import JointGraph, ancestors
from memfit.analysis.simulate import StepSimulation, simulate_step
from memfit.analysis.transfers import TransferSchedule
from memfit.planning.budget import BudgetError
from memfit.planning.fusion import COMPILE_BUDGETS, fused_plan, torch_compile_plans
from memfit.planning.keep_rules import (
    always_kept,
    keep_all,
    keep_blocks,
    keep_heavy,
    keep_min_peak,
)
from memfit.planning.refine import refine_least_peak
from memfit.planning.segments import SegmentModel
from memfit.units import format_bytes
from memfit.warn import warn_user

__all__ = [
    "MIN_GAP",
    "Candidate",
    "activations",
    "pareto_frontier",
    "pareto",
    "choose",
    "least_kept_point",
    "least_peak_point",
    "warn_cut",
]

#: Points closer than this share of plain autograd's simulated peak to a cheaper point are one
#: point: the measurement could not tell them apart.
MIN_GAP = 0.01

#: Safety net: seconds after which the counted search stops, with a warning. The largest graphs
#: measured take 5-6 s on one idle core (a 60-layer GPT-2, a 10,000-node MLP: README, "Planning
#: time"), so a busy machine stays well inside it.
SEARCH_SAFETY_LIMIT_S = 60.0

#: Safety net: seconds from the start of ``pareto_frontier`` after which no more Inductor
#: candidates (``_fused_points``) are solved, with a warning. Their number is fixed; this is never
#: reached on the zoo or the frontier benchmark's models (10 s for a 1,700-node ResNet on 2 cores).
FUSED_SAFETY_LIMIT_S = 120.0


@dataclass(frozen=True)
class Candidate:
    """One simulated plan: what it keeps, its predicted peak and what it recomputes."""

    kept: frozenset[fx.Node]
    peak_bytes: int
    recompute_seconds: float
    recompute_flops: int
    source: str
    simulation: StepSimulation
    #: what this plan offloads (``planning.offload``); None for recompute-only plans
    schedule: TransferSchedule | None = None
    #: under Inductor, the traffic of what it keeps (``analysis.cost.keeping_seconds``)
    keep_seconds: float = 0.0

    @property
    def stall_seconds(self) -> float:
        return self.schedule.stall_seconds if self.schedule else 0.0

    @property
    def cost_seconds(self) -> float:
        """What the plan adds to a step: recomputation, waiting for the link and, under
        Inductor, keeping its values."""
        return self.recompute_seconds + self.stall_seconds + self.keep_seconds


def _costs(jg: JointGraph) -> dict[fx.Node, tuple[float, int]]:
    """Each forward node's estimated seconds and FLOPs, what recomputing it costs."""
    return {
        n: (node_seconds(n, jg.sizes, jg.fused_elementwise), node_flops(n, jg.sizes))
        for n in jg.forward
    }


def _point(
    jg: JointGraph, kept: set[fx.Node], source: str, costs: dict[fx.Node, tuple[float, int]]
) -> Candidate:
    sim = simulate_step(jg, kept)
    recomputed = [costs[n] for n in sim.backward if n in costs]
    return Candidate(
        kept=frozenset(kept),
        peak_bytes=sim.peak_bytes,
        recompute_seconds=float(sum(c[0] for c in recomputed)),
        recompute_flops=int(sum(c[1] for c in recomputed)),
        source=source,
        simulation=sim,
        # activations walks the graph: not for every candidate where keeping costs nothing
        keep_seconds=keeping_seconds(jg, activations(jg, kept)) if jg.fused_elementwise else 0.0,
    )


def activations(jg: JointGraph, kept: set[fx.Node]) -> list[fx.Node]:
    """What keeping ``kept`` holds for backward beyond what the step returns anyway (its
    outputs) and what existed before it (parameters, inputs), in graph order: what a plan
    reports as kept, and the values whose keeping costs time."""
    outputs = set(jg.fwd_outputs)
    saved = jg.saved_needed(kept)
    return [n for n in jg.nodes if n in saved and n.op != "placeholder" and n not in outputs]


def pareto_frontier(
    jg: JointGraph,
    *,
    grid: int = 20,
    time_limit_s: float = SEARCH_SAFETY_LIMIT_S,
    min_gap: float = MIN_GAP,
) -> list[Candidate]:
    """Simulated Pareto-optimal plans of ``jg``, sorted by increasing peak (decreasing cost).

    ``time_limit_s`` is a safety net for the counted search (see the module docstring): reaching
    it warns, since the plan then depends on how fast the machine was.
    """
    started = time.perf_counter()
    costs = _costs(jg)
    baseline = keep_all(jg)
    points = [
        _point(jg, baseline, "none", costs),
        _point(jg, keep_heavy(jg), "speed", costs),
        _point(jg, keep_min_peak(jg), "memory", costs),
    ]
    blocks = keep_blocks(jg)
    if blocks is not None:
        points.append(_point(jg, blocks, "blocks", costs))
    seen = {p.kept for p in points}
    base = points[0]
    bw_read = {n for n in baseline if n.op != "placeholder"}
    always = always_kept(jg)
    model = SegmentModel(jg, always, bw_read, seconds={n: c[0] for n, c in costs.items()})
    store_all = model.store_all_bytes
    # The grid runs from the least modelled peak any segment plan reaches (found by bisection on
    # feasibility: the model's error differs between plans, so the simulated "memory" point says
    # little about where the model's own minimum lies) up to keeping everything.
    deadline = started + time_limit_s
    cut = False  # whether the safety net stopped counted work
    lo, hi = 0.0, max(store_all, 1.0)
    for _ in range(10):
        if time.perf_counter() > deadline:
            cut = True
            break
        mid = (lo + hi) / 2
        if model.solve(mid) is None:
            lo = mid
        else:
            hi = mid
    lo, hi = hi, max(store_all, hi * 1.01)
    for budget in np.geomspace(lo, hi, grid):
        if time.perf_counter() > deadline:
            cut = True
            break
        segments = model.solve(float(budget))
        if segments is None:
            continue
        kept = jg.saved_needed(model.kept_nodes(segments) | always)
        key = frozenset(kept)
        if key in seen:
            continue
        seen.add(key)
        points.append(_point(jg, kept, "budget", costs))
    # The model places checkpoints by segment totals; near the least peak the simulator's view of
    # which tensors meet at the peak decides, so a local search in the simulator goes further.
    # A simulation's cost grows with the graph, so larger graphs get fewer: about 250 on a
    # thousand nodes, 64 from 4,000 nodes up (counted, not timed: the plan must not depend on how
    # busy the machine is).
    lowest = min(points, key=lambda p: p.peak_bytes)
    refined, _ = refine_least_peak(
        jg,
        set(lowest.kept),
        max_simulations=max(64, 250_000 // max(len(jg.nodes), 1)),
        deadline=deadline,
    )
    cut = cut or time.perf_counter() > deadline  # the local search stops at the deadline
    if frozenset(refined) not in seen:
        seen.add(frozenset(refined))
        points.append(_point(jg, refined, "refined", costs))
    if cut:
        warn_cut(jg, f"its {time_limit_s:g} s limit for the search")
    if jg.fused_elementwise:
        points += _fused_points(jg, pareto(points, min_gap * base.peak_bytes), costs, seen, started)
    return pareto(points, min_gap * base.peak_bytes)


def warn_cut(jg: JointGraph, what: str) -> None:
    """Tell the user a search's safety-net time limit cut its counted work short."""
    warn_user(
        f"memfit: planning a graph of {len(jg.nodes)} nodes reached {what} before its counted "
        "work was done; the plan holds the points found so far (budgets are still met or "
        "refused), but it depends on this machine's speed and load, so another run may plan "
        "differently"
    )


def _fused_points(
    jg: JointGraph,
    frontier: list[Candidate],
    costs: dict[fx.Node, tuple[float, int]],
    seen: set[frozenset[fx.Node]],
    started: float,
) -> list[Candidate]:
    """Under Inductor: each frontier plan with fusible recomputation added, and the plans
    ``torch.compile`` makes at ``COMPILE_BUDGETS`` (``planning.fusion``), those not seen yet.
    Each frontier plan is one min-cut solve, ``torch.compile``'s plans one more (they share
    their min-cuts); all are solved unless ``FUSED_SAFETY_LIMIT_S`` is reached."""
    found: list[Candidate] = []
    # (the sources of the plans one solve makes, the solve)
    candidates: list[tuple[list[str], Callable[[], list[set[fx.Node]]]]] = [
        ([f"fused {p.source}"], partial(_one, fused_plan, jg, set(p.kept))) for p in frontier
    ]
    # torch.compile's plans share their min-cuts, so they are solved together
    candidates.append(
        (
            [f"torch.compile {b:g}" for b in COMPILE_BUDGETS],
            partial(torch_compile_plans, jg, COMPILE_BUDGETS),
        )
    )
    for i, (sources, make) in enumerate(candidates):
        if time.perf_counter() - started > FUSED_SAFETY_LIMIT_S:
            warn_cut(
                jg,
                f"the {FUSED_SAFETY_LIMIT_S:g} s safety limit for Inductor candidates "
                f"({i} of {len(candidates)} solved)",
            )
            break
        for kept, source in zip(make(), sources, strict=True):
            key = frozenset(kept)
            if key in seen:
                continue
            seen.add(key)
            found.append(_point(jg, kept, source, costs))
    return found


def _one(
    make: Callable[[JointGraph, set[fx.Node]], set[fx.Node]], jg: JointGraph, kept: set[fx.Node]
) -> list[set[fx.Node]]:
    return [make(jg, kept)]


def pareto(points: list[Candidate], gap: float) -> list[Candidate]:
    """Points no other point beats in both peak and cost, at least ``gap`` bytes apart.

    The least peak of all is always kept, even within ``gap`` of a cheaper point: it is what
    ``"memory"`` promises and the smallest budget memfit can meet.
    """
    by_cost = sorted(points, key=lambda p: (p.cost_seconds, p.peak_bytes))
    kept: list[Candidate] = []
    for p in by_cost:
        if not kept or p.peak_bytes < kept[-1].peak_bytes - gap:
            kept.append(p)
    lowest = min(by_cost, key=lambda p: p.peak_bytes)
    if lowest.peak_bytes < kept[-1].peak_bytes:
        kept.append(lowest)
    return sorted(kept, key=lambda p: p.peak_bytes)


def least_peak_point(frontier: list[Candidate], base_peak_bytes: int, estimate: bool) -> Candidate:
    """``"memory"``'s point: the frontier's lowest; where its peaks are an ``estimate`` of what
    runs (Inductor's), the cheapest within ``MIN_GAP`` of ``base_peak_bytes`` of the lowest.

    Why: ``pareto`` keeps the least simulated peak even a few bytes below a much cheaper point,
    since eager ``"memory"`` promises it. Under Inductor compiled plans measured 0.85-1.3x their
    simulation, so those bytes mean nothing there, and each plan tried is a compile: on a CIFAR
    ResNet the least-peak point, 120 B below one recomputing 1.89 GFLOP, recomputed 2.48 GFLOP,
    and the measured search compiled both (20-40 s each on 2 CPU cores) to keep the cheaper.
    """
    lowest = frontier[0]
    if not estimate:
        return lowest
    near = lowest.peak_bytes + MIN_GAP * base_peak_bytes
    return min(
        (p for p in frontier if p.peak_bytes <= near), key=lambda p: (p.cost_seconds, p.peak_bytes)
    )


def least_kept_point(jg: JointGraph, frontier: list[Candidate]) -> Candidate:
    """``"memory"``'s point for a graph whose runs a step's chain drops and replays
    (``planning.plan_chain``): the least kept, then the least peak, among the frontier and the plan
    that keeps only its inputs and what no plan recomputes (random masks).

    Why not the lowest peak: what a dropped run keeps comes back when its segment is replayed
    and is held, beside what every other run of the segment keeps, until the backward reaches
    it; the segment's sum is the step's peak, and the graph's own peak only a part of it. On a
    chain of eight pairs of Linears broken by a branch after each pair, the lowest-peak plan of
    each pair kept its ReLU (it cost that graph's peak nothing) and the replayed segments held
    it too.
    """
    costs = _costs(jg)
    # Its outputs its backward reads too (a tanh's): the runs after it may not hold them, and a
    # dropped run's replay would make them again to hold until its backward. Not the outputs
    # it does not read (the new running statistics of a BatchNorm: recomputed, they would read
    # the statistics the forward has since updated).
    read = keep_all(jg)
    static = {p for i, p in enumerate(jg.primals) if i in jg.static_inputs}
    # inputs that live with the module and get no gradient
    buffers = {p for p, grad in zip(jg.primals, jg.grads_by_primal) if grad is None} & static
    held = {
        n
        for n in jg.fwd_outputs
        if n in read
        and not jg.never_recompute(n)
        and not any(a in buffers for m in ancestors([n]) for a in m.all_input_nodes)
    }
    kept = always_kept(jg)
    least = [_point(jg, jg.saved_needed(kept), "least kept", costs)]
    if held:
        least.append(_point(jg, jg.saved_needed(kept - held), "least kept", costs))

    def saved_bytes(p: Candidate) -> int:
        """What it saves, its inputs included: a saved input is held by the replay too, unless
        the run before saves it as its output (then they share it)."""
        return jg.bytes_of((n for n in jg.saved_needed(p.kept) if n not in static), primals=True)

    # Where keeping its outputs saves as much, keep them (the next run often saves them as its
    # inputs, and a value the two save is held once): min keeps the first of equals.
    return min([*least, *frontier], key=saved_bytes)


def choose(frontier: list[Candidate], budget_bytes: int) -> Candidate:
    """The cheapest point whose predicted peak is within ``budget_bytes``; BudgetError if none."""
    fits = [p for p in frontier if p.peak_bytes <= budget_bytes]
    if not fits:
        smallest = min(p.peak_bytes for p in frontier)
        raise BudgetError(
            f"no plan fits a budget of {format_bytes(budget_bytes)}: the smallest peak memfit can "
            f"reach for this graph is {format_bytes(smallest)} ({smallest} bytes)",
            budget_bytes=budget_bytes,
            least_bytes=smallest,
        )
    return min(fits, key=lambda p: (p.cost_seconds, p.peak_bytes))
