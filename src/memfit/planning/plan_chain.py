"""A step's graphs as one chain: which runs of a step with graph breaks drop what they keep in
the forward and replay their forward in the backward, and the step's peak that follows.

Where a model's own Python breaks the capture (a data-dependent ``if``, an ``.item()``, a print),
Dynamo hands memfit one small graph per stretch of straight-line code, and a step runs them in
order (a *run* is one graph running once). Planned one at a time, each graph keeps what its own
backward reads, and the values passed from graph to graph are kept by the graph after: a chain
of 100 layers keeps 100 layers' activations whatever each graph does inside. Planned together,
the runs are cut into *segments* of consecutive runs, as ``torch.utils.checkpoint`` cuts a
sequential model (Chen et al.'s sqrt(n) chain): a dropped segment keeps only the values that
enter it from outside; when the backward reaches it, memfit runs the segment's graphs forward
again (``execution.run_chain``), each on the values the runs before it just made, and each run's
backward then finds what its plan keeps. Nothing in the user's Python runs again: the graphs
replayed are the ones that ran, so the branch taken is the one taken in the forward.

The rule that cuts segments is online, because a step with a data-dependent branch may run a
sequence of graphs never seen before: runs join the open segment until what they would keep
(``ChainRun.cost``) reaches ``ChainPlan.segment_bytes``, which closes it. ``choose`` tries one
threshold per segment count on the step just recorded, simulates each (``simulate``), and keeps
the one with the least peak; the next step runs under it, whatever its branches.

The data here is plain: ``execution.run_chain`` records ``ChainRun``/``ChainValue`` as a step runs
and reads ``ChainPlan``; ``Plan`` shows a ``ChainSummary``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "ChainPlan",
    "ChainRun",
    "ChainSummary",
    "ChainValue",
    "KEEP_ALL",
    "choose",
    "segment_cost",
    "segments_of",
    "simulate",
    "summary",
]


@dataclass(frozen=True)
class ChainRun:
    """One run of a graph in a step, in the planner's numbers (its ``GraphPlan``'s)."""

    key: str  # the graph and its sizes (``GraphPlan.sized_key``)
    forward_peak: int  # above what the step held before it; its outputs and kept values included
    backward_peak: int  # its backward's peak, its kept values included
    kept: int  # what its backward reads that it made itself (not its inputs, not its outputs)
    parameter_grads: int  # parameter gradients its backward leaves (alive until the step ends)
    forward_flops: int  # what replaying it costs
    output_bytes: int  # its outputs
    #: whether it can be dropped and replayed (a training run of the eager executor, no offload)
    droppable: bool = True
    #: bytes of the random state a dropped run keeps for its replay (0: it draws nothing)
    random_state_bytes: int = 0

    @property
    def cost(self) -> int:
        """What keeping the run costs until its backward, as the segment rule counts it."""
        return segment_cost(self.kept, self.output_bytes)


def segment_cost(kept_bytes: int, output_bytes: int) -> int:
    """What a run adds to its segment: what it keeps and its outputs. One rule for the runs
    ``execution.run_chain`` cuts as a step runs and for the runs ``segments_of`` cuts in
    planning."""
    return kept_bytes + output_bytes


@dataclass(frozen=True)
class ChainValue:
    """A tensor one run made and later runs (or code outside memfit's graphs) use."""

    producer: int  # the run that made it
    nbytes: int  # its storage's bytes
    readers: tuple[int, ...] = ()  # runs that took it as an input
    savers: tuple[int, ...] = ()  # runs whose backward reads it (the producer, if it saves it)
    #: held by something else until the step ends (eager autograd, the caller): seen alive when
    #: the forward ended with no run of memfit's holding it
    pinned: bool = False


@dataclass(frozen=True)
class ChainPlan:
    """What the runs of the next steps do: join a segment until its runs' ``cost`` reaches
    ``segment_bytes``, which closes it; ``None``: drop nothing."""

    segment_bytes: int | None


#: Drop nothing: every run keeps what its plan keeps (the first step, and where nothing helps).
KEEP_ALL = ChainPlan(None)


@dataclass(frozen=True)
class ChainSummary:
    """How one step's runs were cut, and what that predicts (shown by ``Plan``)."""

    runs: int
    #: the dropped segments, first and last run of each; each is replayed once in the backward
    segments: tuple[tuple[int, int], ...]
    peak_bytes: int  # the step's predicted peak, memfit's graphs only
    keep_all_peak_bytes: int  # the same runs with nothing dropped
    replay_flops: int  # the forward FLOPs the backward runs again
    forward_flops: int  # one forward of every run
    held_bytes: int  # what the step holds from its forward to its backward

    @property
    def replayed(self) -> int:
        return sum(last - first + 1 for first, last in self.segments)


def segments_of(runs: Sequence[ChainRun], plan: ChainPlan) -> list[tuple[int, int]]:
    """The segments the online rule of ``plan`` cuts ``runs`` into, as ``execution.run_chain``
    cuts them while the step runs (a run that cannot be dropped ends the open segment)."""
    if plan.segment_bytes is None:
        return []
    segments: list[tuple[int, int]] = []
    start: int | None = None
    spent = 0
    for i, run in enumerate(runs):
        if not run.droppable:
            if start is not None:
                segments.append((start, i - 1))
                start = None
            continue
        if start is None:
            start, spent = i, 0
        spent += run.cost
        if spent >= plan.segment_bytes:
            segments.append((start, i))
            start = None
    if start is not None:
        segments.append((start, len(runs) - 1))
    return segments


def simulate(
    runs: Sequence[ChainRun],
    values: Sequence[ChainValue],
    segments: Sequence[tuple[int, int]],
) -> tuple[int, int]:
    """The step's peak and the bytes held from forward to backward when ``segments`` are dropped.

    The forward runs in order; a run that is not dropped adds what it keeps, and a value is
    held from the run that made it to its backward where something holds it: a saver that is not
    dropped, a dropped run that takes it from outside its own segment (its replay needs it), or
    code outside memfit's graphs (``pinned``). A value nothing holds lives until the runs that
    read it have run. The backward runs in reverse; at a dropped segment's last run, the
    segment's runs run forward again, leaving what each keeps and the values the segment's own
    runs save; then each run's backward peaks at its own ``backward_peak`` above what is held,
    with the parameter gradients of the runs after it.
    """
    n = len(runs)
    segment = [-1] * n
    for number, (first, last) in enumerate(segments):
        for i in range(first, last + 1):
            segment[i] = number
    dropped = [s >= 0 for s in segment]

    # held after the forward: what a run keeps, or a dropped run's random state
    added = [r.random_state_bytes if dropped[i] else r.kept for i, r in enumerate(runs)]
    transient = [0] * n  # inputs alive only until they are read
    released = [0] * n  # freed after each run's backward
    early = [0] * n  # freed as each run's backward starts (``execution.run_chain``'s release)
    #: freed as the backward reaches each run: what code outside memfit's graphs held of its
    #: outputs (the caller's output, as ``GraphPlan.backward_peak`` counts it if still held)
    let_go = [0] * n
    replayed = [0] * n  # what replaying each run leaves until the backward reaches its saver
    for v in values:
        p = v.producer
        holders = [c for c in v.savers if not dropped[c]]
        holders += [
            c for c in v.readers if dropped[c] and (not dropped[p] or segment[c] != segment[p])
        ]
        if v.pinned or holders:
            added[p] += v.nbytes
            if not holders:
                let_go[p] += v.nbytes
            elif dropped[min(holders)] and min(holders) not in v.savers:
                # held for the replay only: let go as that run's backward gets its values
                early[min(holders)] += v.nbytes
            else:
                released[min(holders)] += v.nbytes
        else:
            for c in v.readers:
                transient[c] += v.nbytes
        if dropped[p]:
            inner = [c for c in v.savers if dropped[c] and segment[c] == segment[p]]
            if inner:
                replayed[p] += v.nbytes
                released[min(inner)] += v.nbytes

    peak = live = 0
    for i, r in enumerate(runs):
        peak = max(peak, live + transient[i] + r.forward_peak)
        live += added[i]
    held = sum(added)  # what the runs keep, and the values held
    later = [0] * (n + 1)
    for i in range(n - 1, -1, -1):
        later[i] = later[i + 1] + runs[i].parameter_grads
    last_of = {last: first for first, last in segments}
    for j in range(n - 1, -1, -1):
        live -= let_go[j]
        if j in last_of:
            made = 0
            for k in range(last_of[j], j + 1):
                peak = max(peak, live + later[j + 1] + made + runs[k].forward_peak)
                made += runs[k].kept + replayed[k]
            live += made
        live -= early[j]
        r = runs[j]
        peak = max(peak, live - r.kept + later[j + 1] + r.backward_peak)
        live -= r.kept + released[j] + (r.random_state_bytes if dropped[j] else 0)
    return peak, held


def _thresholds(runs: Sequence[ChainRun], most: int = 48) -> list[int]:
    """Thresholds that cut the droppable runs into 1, 2, ... n segments of about equal cost
    (at most ``most`` of them, spread geometrically where there are more runs)."""
    total = sum(r.cost for r in runs if r.droppable)
    n = sum(1 for r in runs if r.droppable)
    if not total or not n:
        return []
    if n <= most:
        counts = list(range(1, n + 1))
    else:
        counts = sorted({max(1, round(n ** (i / (most - 1)))) for i in range(most)})
    return sorted({max(1, math.ceil(total / k)) for k in counts}, reverse=True)


def choose(
    runs: Sequence[ChainRun],
    values: Sequence[ChainValue],
    budget_bytes: int | None = None,
) -> ChainPlan:
    """The segment rule for steps like this one: the least simulated peak (``"memory"``), or,
    with ``budget_bytes``, the fewest replayed FLOPs whose peak fits it (the least peak if
    none does). Dropping nothing is a candidate, so the rule is never worse than keeping."""
    best = KEEP_ALL
    best_peak, _ = simulate(runs, values, [])
    best_flops = 0
    if budget_bytes is not None and best_peak <= budget_bytes:
        return best
    fits = False
    for threshold in _thresholds(runs):
        plan = ChainPlan(threshold)
        segments = segments_of(runs, plan)
        peak, _ = simulate(runs, values, segments)
        flops = sum(runs[i].forward_flops for a, b in segments for i in range(a, b + 1))
        if budget_bytes is not None and peak <= budget_bytes:
            if not fits or flops < best_flops:
                best, best_peak, best_flops, fits = plan, peak, flops, True
        elif not fits and (peak < best_peak or (peak == best_peak and flops < best_flops)):
            best, best_peak, best_flops = plan, peak, flops
    return best


def summary(
    runs: Sequence[ChainRun],
    values: Sequence[ChainValue],
    segments: Sequence[tuple[int, int]],
) -> ChainSummary:
    """What ``segments`` predict for this step, for ``Plan``."""
    peak, held = simulate(runs, values, segments)
    keep_all, _ = simulate(runs, values, [])
    return ChainSummary(
        runs=len(runs),
        segments=tuple(segments),
        peak_bytes=peak,
        keep_all_peak_bytes=keep_all,
        replay_flops=sum(runs[i].forward_flops for a, b in segments for i in range(a, b + 1)),
        forward_flops=sum(r.forward_flops for r in runs),
        held_bytes=held,
    )
