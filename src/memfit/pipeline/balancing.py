"""Exact contiguous stage balance for additive costs: the least GPipe step, and its formula.

A GPipe pipeline runs a chain of layers as ``K`` contiguous stages, one per device, and pushes
``M`` micro-batches through them; a step takes ``(M - 1) * max(stage time) + sum(stage time)``,
so the slowest stage sets the throughput, and every stage must fit its device's memory.
torchgpipe balances with the block-partition heuristic of Bárány et al. (its docstring: "might
not be optimal"); DeepSpeed's ``partition_method="parameters"`` minimises the spread of
parameter counts, not the largest stage. Neither looks at memory. Here the problem is solved
exactly, with memory as a hard per-stage constraint, for costs that add up per stage (the
planner itself searches non-additive stage costs with ``intervals.balance_intervals``, which
:func:`balance_pipeline` checks in the tests):

* the least largest stage cost, the search's lower bound and its start, by Nicol's parametric
  search (D. Nicol, "Rectilinear partitioning of irregular data parallel computations", JPDC 1994;
  the presentation of Pınar & Aykanat, JPDC 2004): the optimum is the cost of some stage, and the
  first stage of an optimal partition is found by binary search over its end with a greedy
  feasibility probe, after which the problem repeats on the rest with one stage fewer. A probe
  takes ``O(K log n)`` (bisection over prefix sums, each stage extended as far as both its cost
  bound and the memory capacity allow); the search makes ``O(K log n)`` probes, so ``O(n log n + K²
  log² n)`` in all, the memory limits of each position included.
* :func:`balance_pipeline` minimises the predicted step time itself, with a transfer cost for
  each possible cut: a DP over cut positions (least total transfer under a bound on the stage
  time, a heap sweep per stage count) for candidate bounds in increasing order, stepping from
  one drop of the least transfer to the next by a galloping search, stopped once the bound
  alone rules out any improvement.

Stage sums are differences of prefix sums accumulated left to right, the same numbers the
searches compare, so "optimal" holds for exactly the values reported; for
integer-valued inputs below 2**53 they are exact sums. Memory is additive per stage (a stage
needs the sum of its items' bytes) and capacity is the same for every stage.

Ties are broken the same way everywhere: among optimal partitions the one with the earliest
cuts (lexicographically smallest cut positions, so the first stage is as short as it may be);
:func:`balance_pipeline` first prefers the smallest slowest stage among equal step times.
"""

from __future__ import annotations

import math
import sys
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from functools import partial
from heapq import heappop, heappush
from itertools import accumulate

__all__ = ["balance_pipeline", "pipeline_step_time"]

#: Relative slack when comparing step times that reach the same value by different sums
#: (float rounding); integer-valued inputs compare exactly.
_TOLERANCE = 1e-12


def _bottleneck(
    cost: list[float], stages: int, memory: Sequence[float] | None, capacity: float | None
) -> tuple[list[float], list[int], list[int], float]:
    """What both searches start from: the prefix sums of ``cost``, how far each stage may reach
    right and left within ``capacity`` (``_memory_limits``), and the least largest stage cost
    (``_min_bottleneck``). Raises ``ValueError`` where no partition fits ``capacity``."""
    n = len(cost)
    mem_prefix, cap = _check_memory(memory, capacity, n)
    prefix = _prefix(cost)
    right, left = _memory_limits(mem_prefix, cap, n)
    if mem_prefix is not None:
        _check_capacity(mem_prefix, cap, stages, right)
    return prefix, right, left, _min_bottleneck(prefix, right, stages)


def balance_pipeline(
    costs: Sequence[float],
    stages: int,
    *,
    microbatches: int,
    cut_costs: Sequence[float] | None = None,
    memory: Sequence[float] | None = None,
    capacity: float | None = None,
) -> list[int]:
    """Stage sizes minimising a GPipe step's predicted time, transfers between stages included.

    The model. ``costs[i]`` is item ``i``'s forward plus backward time per micro-batch;
    ``cut_costs[i]`` (``len(costs) - 1`` values) is the time to move what crosses a cut between
    items ``i`` and ``i + 1`` (activation forward, its gradient backward), paid by the stage
    before the cut and not overlapped with its compute. Stage ``s`` takes ``t_s`` = its items'
    costs plus its outgoing cut's cost (none for the last stage) per micro-batch, and the step
    is the fill-drain time of ``M = microbatches`` identical micro-batches through ``K`` stages
    in a row::

        T = (M - 1) * max_s t_s + sum_s t_s

    (exact for a flow shop of identical jobs; for GPipe's forward then backward waves it is
    exact when each stage's backward time is proportional to its forward time, and otherwise
    an upper bound). See :func:`pipeline_step_time`. With ``memory`` (bytes per item) and
    ``capacity`` (bytes per stage), every stage's summed memory stays ``<= capacity``; a
    ``ValueError`` names the smallest capacity that fits when none does. Without cut costs the
    result is the partition with the least slowest stage (``_min_bottleneck``).

    The algorithm. For a bound ``B`` on ``max_s t_s``, a DP over cut positions finds the least
    total cut cost ``g(B)`` with every stage within ``B`` and ``capacity`` (``O(K n log n)``,
    see ``_least_cuts``). ``g`` falls in steps as ``B`` grows, and the best time with a given
    least cut cost is at the first bound of its step, where ``T = (M - 1) * B + sum(costs) +
    g(B)``. Bounds are the stage times of all intervals between a lower bound (the least
    slowest stage) and the bound at which ``(M - 1) * B`` alone makes the step slower than with
    that partition; the search walks from step to step in increasing ``B``, each
    found by a galloping search, and stops when ``(M - 1) * B + sum(costs) + g(inf)`` cannot
    beat the best found or the least cut cost is reached. ``O(n L + D K n log n)`` for ``D``
    DPs (about two per step visited, more for far steps) and ``L`` items in the longest stage
    considered. Measured (one core, uniform random costs, cut costs up to 0.3 of an item):
    200 items, K = 16: 0.01-0.08 s; 500 items, K = 32: 0.2 s (M = 1), 1.1 s (M = 4), 0.3 s
    (M = 16); 1,000 items, K = 64, M = 4: 15 s (``g`` has hundreds of steps there). Meant for
    per-layer chains; for per-node chains of thousands of items, balance per layer.
    Exact up to a relative ``1e-12`` where different sums meet in float rounding; exact for
    integer-valued inputs. Ties: the smallest slowest stage, then the earliest cuts.
    """
    cost = _check_values("costs", costs)
    n = len(cost)
    _check_stages(stages, n)
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be an int >= 1, got {microbatches!r}")
    cuts = _check_cut_costs(cut_costs, n)
    prefix, right, left, lower = _bottleneck(cost, stages, memory, capacity)
    start = _earliest_cuts(prefix, left, stages, lower)
    if not any(cuts):
        return start
    return _least_step(prefix, cuts, left, right, stages, microbatches, lower, start)


def _least_step(
    prefix: list[float],
    cuts: list[float],
    left: list[int],
    right: list[int],
    stages: int,
    microbatches: int,
    lower: float,
    start: list[int],
) -> list[int]:
    """``balance_pipeline``'s search with cut costs: from ``start`` (the least slowest stage's
    partition, whose slowest stage is ``lower``), walk the steps of the least cut cost as the
    bound on the slowest stage grows, keeping the least step time."""
    least = _least_cuts(prefix, cuts, left, stages, math.inf)
    assert least is not None  # the memory check above found a partition
    least_cut = least[0]
    floor = prefix[-1] + least_cut  # sum(costs) + the least possible cut cost: T >= this
    tol = _TOLERANCE * floor
    best_sizes = start
    best_time = _step_time_of(prefix, cuts, start, microbatches)
    best_max = max(_stage_times(prefix, cuts, start))

    def worth(bound: float) -> bool:
        """Whether a partition whose slowest stage takes ``bound`` may still beat the best."""
        return (microbatches - 1) * bound + floor < best_time + tol

    upper = math.inf  # no partition with a slower slowest stage can beat ``start``
    if microbatches > 1:
        upper = max(best_time - floor, 0.0) / (microbatches - 1)
        upper += 1e-9 * upper + 1e-300  # rounding in the bound must not drop a candidate
    bounds = _interval_times(prefix, cuts, right, lower, upper)

    solved: dict[int, tuple[float, list[int]] | None] = {}

    def least_at(i: int) -> tuple[float, list[int]] | None:
        if i not in solved:
            solved[i] = _least_cuts(prefix, cuts, left, stages, bounds[i])
        return solved[i]

    def level(lo: int, hi: int, good: Callable[[float], bool]) -> int:
        """The first index in ``lo:hi`` whose least cut cost is ``good`` (else hi)."""

        def below(i: int) -> bool:
            found = least_at(i)
            return found is not None and good(found[0])

        return _first_true(lo, hi, below)

    # The least cut cost under a bound only falls as the bound grows, in steps; the best time
    # with a given least cut cost is at the step's first bound (every partition attaining it
    # there has that slowest stage). So walk from step to step.
    # With one micro-batch only the cut cost counts: go straight to its least value's step.
    if microbatches > 1:
        i = level(0, len(bounds), lambda v: True)
    else:
        i = level(0, len(bounds), lambda v: v <= least_cut + tol)
    while i < len(bounds) and worth(bounds[i]):
        found = least_at(i)
        assert found is not None
        sizes = found[1]
        time = _step_time_of(prefix, cuts, sizes, microbatches)
        slowest = max(_stage_times(prefix, cuts, sizes))
        if (time, slowest, _cuts(sizes)) < (best_time, best_max, _cuts(best_sizes)):
            best_sizes, best_time, best_max = sizes, time, slowest
        if found[0] <= least_cut + tol:
            break
        end = len(bounds)
        if microbatches > 1:
            end = bisect_right(bounds, (best_time + tol - floor) / (microbatches - 1))
        i = level(i + 1, end, partial(_below, found[0] - tol))
    return best_sizes


def _first_true(lo: int, hi: int, test: Callable[[int], bool]) -> int:
    """The first index in ``lo:hi`` where the monotone ``test`` holds (else ``hi``).

    Galloping, then bisection: in ``balance_pipeline`` the next step is usually a few bounds
    away.
    """
    stride = 1
    while lo < hi:
        probe = min(lo + stride - 1, hi - 1)
        if test(probe):
            hi = probe
            break
        lo, stride = probe + 1, 2 * stride
    while lo < hi:
        mid = (lo + hi) // 2
        if test(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def pipeline_step_time(
    costs: Sequence[float],
    sizes: Sequence[int],
    *,
    microbatches: int,
    cut_costs: Sequence[float] | None = None,
) -> float:
    """Predicted GPipe step time ``(M - 1) * max_s t_s + sum_s t_s`` of a partition.

    ``t_s`` is stage ``s``'s summed cost plus the cost of its outgoing cut (none for the last
    stage); the model is described in :func:`balance_pipeline`, which minimises this.

    >>> pipeline_step_time([1, 2, 3, 4], [3, 1], microbatches=4, cut_costs=[0, 0, 1])
    32.0
    """
    vals = _check_values("costs", costs)
    _check_sizes(sizes, len(vals))
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be an int >= 1, got {microbatches!r}")
    cuts = _check_cut_costs(cut_costs, len(vals))
    return _step_time_of(_prefix(vals), cuts, list(sizes), microbatches)


# ------------------------------------------------------------------------------------ checks


def _check_values(name: str, values: Sequence[float]) -> list[float]:
    out: list[float] = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"{name}[{i}] must be a number, got {v!r}")
        f = float(v)
        if not math.isfinite(f) or f < 0:
            raise ValueError(
                f"{name}[{i}] is {v!r}; {name} must be finite and >= 0 "
                "(a time or a number of bytes per item)"
            )
        out.append(f)
    if not out:
        raise ValueError(f"{name} is empty; give one value per item of the chain")
    if not math.isfinite(sum(out)):
        raise ValueError(
            f"{name} sum past the largest float ({sys.float_info.max!r}); express them in a "
            "larger unit (milliseconds, MiB)"
        )
    return out


def _check_stages(stages: int, n: int) -> None:
    if isinstance(stages, bool) or not isinstance(stages, int):
        raise ValueError(f"stages must be an int, got {stages!r}")
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    if stages > n:
        raise ValueError(
            f"stages ({stages}) > number of items ({n}): every stage needs at least one item; "
            f"use at most {n} stages or split the chain finer"
        )


def _check_sizes(sizes: Sequence[int], n: int) -> None:
    for i, s in enumerate(sizes):
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise ValueError(f"sizes[{i}] is {s!r}; stage sizes must be ints >= 1")
    if sum(sizes) != n:
        raise ValueError(f"sizes sum to {sum(sizes)} but there are {n} values; they must match")


def _check_memory(
    memory: Sequence[float] | None, capacity: float | None, n: int
) -> tuple[list[float] | None, float]:
    if memory is None and capacity is None:
        return None, math.inf
    if memory is None:
        raise ValueError(
            f"capacity ({capacity!r}) was given without memory; pass memory= (bytes per item) "
            "too, or neither"
        )
    if capacity is None:
        raise ValueError(
            "memory was given without capacity; pass capacity= (bytes per stage) too, or neither"
        )
    if (
        isinstance(capacity, bool)
        or not isinstance(capacity, (int, float))
        or not math.isfinite(capacity)
        or capacity < 0
    ):
        raise ValueError(f"capacity must be a finite number >= 0, got {capacity!r}")
    mem = _check_values("memory", memory)
    if len(mem) != n:
        raise ValueError(f"memory has {len(mem)} values but costs has {n}; give one value per item")
    return _prefix(mem), float(capacity)


def _check_cut_costs(cut_costs: Sequence[float] | None, n: int) -> list[float]:
    if cut_costs is None:
        return [0.0] * (n - 1)
    if len(cut_costs) != n - 1:
        raise ValueError(
            f"cut_costs has {len(cut_costs)} values but {n} items have {n - 1} places to cut; "
            "give cut_costs[i] for the cut between items i and i + 1"
        )
    if n == 1:
        return []
    return _check_values("cut_costs", cut_costs)


def _check_capacity(mem_prefix: list[float], cap: float, stages: int, right: list[int]) -> None:
    """Raise when no partition into ``stages`` stages keeps every stage within ``cap``."""
    n = len(mem_prefix) - 1
    if _probe(mem_prefix, right, 0, stages, math.inf):
        return
    items = [mem_prefix[i + 1] - mem_prefix[i] for i in range(n)]
    need = _min_bottleneck(mem_prefix, [n] * (n + 1), stages)
    biggest = max(range(n), key=items.__getitem__)
    detail = (
        f"item {biggest} alone needs {items[biggest]!r}"
        if items[biggest] > cap
        else f"the memory totals {mem_prefix[-1]!r}"
    )
    raise ValueError(
        f"no partition of {n} items into {stages} stages keeps every stage's memory <= "
        f"capacity ({cap!r}); {detail}. The smallest capacity that fits {stages} stages is "
        f"{need!r} (the least, over partitions, of the largest stage's memory): raise capacity "
        "to at least that, use more stages, or cut per-item memory (recompute, offload)"
    )


# ------------------------------------------------------------------------------ the searches


def _prefix(values: list[float]) -> list[float]:
    return [0.0, *accumulate(values)]


def _reach_right(prefix: list[float], i: int, bound: float) -> int:
    """Largest ``e >= i`` with ``prefix[e] - prefix[i] <= bound``."""
    n = len(prefix) - 1
    base = prefix[i]
    e = bisect_right(prefix, base + bound, i) - 1
    # base + bound is rounded; fix the few positions where the difference decides otherwise
    while e < n and prefix[e + 1] - base <= bound:
        e += 1
    while prefix[e] - base > bound:
        e -= 1
    return e


def _reach_left(prefix: list[float], e: int, bound: float, extra: float = 0.0) -> int:
    """Smallest ``b <= e`` with ``prefix[e] - prefix[b] + extra <= bound`` (``e`` if none)."""
    top = prefix[e]
    if extra > bound:
        return e
    b = bisect_left(prefix, top - (bound - extra), 0, e + 1)
    while b > 0 and top - prefix[b - 1] + extra <= bound:
        b -= 1
    while b < e and top - prefix[b] + extra > bound:
        b += 1
    return b


def _memory_limits(
    mem_prefix: list[float] | None, cap: float, n: int
) -> tuple[list[int], list[int]]:
    """For each position, how far a stage may run right (from it) and left (to it) in memory."""
    if mem_prefix is None:
        return [n] * (n + 1), [0] * (n + 1)
    right = [_reach_right(mem_prefix, i, cap) for i in range(n + 1)]
    left = [_reach_left(mem_prefix, e, cap) for e in range(n + 1)]
    return right, left


def _probe(prefix: list[float], right: list[int], start: int, stages: int, bound: float) -> bool:
    """Whether items ``start:`` fit in at most ``stages`` stages of cost <= ``bound``.

    Greedy: each stage runs as far as its cost bound and the memory limit allow. With
    non-negative values this needs the fewest stages, and a cover by fewer than ``stages``
    stages can be split into exactly ``stages`` non-empty ones without breaking either bound.
    """
    n = len(prefix) - 1
    i = start
    for _ in range(stages):
        if i == n:
            return True
        e = min(_reach_right(prefix, i, bound), right[i])
        if e == i:
            return False
        i = e
    return i == n


def _min_bottleneck(prefix: list[float], right: list[int], stages: int) -> float:
    """The least largest stage cost over partitions into ``stages`` stages (Nicol's search).

    The first stage of some optimal partition ends at ``j1 - 1`` or ``j1``, where ``j1`` is the
    first end whose stage cost, taken as the bound, is feasible: either the optimum is that
    cost, or it lies strictly between the costs ending at ``j1 - 1`` and ``j1``, and then the
    greedy first stage under it ends at ``j1 - 1``; so the search repeats on the rest with one
    stage fewer. When even the longest first stage memory allows is not a feasible bound, the
    optimum exceeds its cost and that stage is taken whole. Feasible input only (the memory
    check runs first).
    """
    n = len(prefix) - 1
    best = math.inf
    floor = 0.0  # the largest cost among the stages fixed so far
    s, k = 0, stages
    while True:
        hi = right[s]
        if k == 1:
            if hi == n:
                best = min(best, max(floor, prefix[n] - prefix[s]))
            return best
        if not _probe(prefix, right, s, k, prefix[hi] - prefix[s]):
            floor = max(floor, prefix[hi] - prefix[s])
            s, k = hi, k - 1
            continue
        lo, top = s + 1, hi
        while lo < top:
            mid = (lo + top) // 2
            if _probe(prefix, right, s, k, prefix[mid] - prefix[s]):
                top = mid
            else:
                lo = mid + 1
        best = min(best, max(floor, prefix[lo] - prefix[s]))
        if lo == s + 1:
            return best
        floor = max(floor, prefix[lo - 1] - prefix[s])
        s, k = lo - 1, k - 1


def _earliest_cuts(prefix: list[float], left: list[int], stages: int, bound: float) -> list[int]:
    """The partition within ``bound`` (and memory) whose cuts come earliest, as sizes.

    Walking back from the end with each stage as long as allowed gives ``first[t]``, the
    earliest start of a suffix that ``t`` stages can cover; cut ``j`` is then the earliest
    position after cut ``j - 1`` from which the remaining ``stages - j`` stages still fit.
    """
    n = len(prefix) - 1
    first = [n]
    for _ in range(stages - 1):
        e = first[-1]
        first.append(0 if e == 0 else max(_reach_left(prefix, e, bound), left[e]))
    cuts = [0]
    for j in range(1, stages):
        cuts.append(max(cuts[-1] + 1, first[stages - j]))
    cuts.append(n)
    return [b - a for a, b in zip(cuts, cuts[1:])]


def _below(limit: float, value: float) -> bool:
    return value < limit


def _cuts(sizes: list[int]) -> list[int]:
    return list(accumulate(sizes))


def _stage_times(prefix: list[float], cuts: list[float], sizes: list[int]) -> list[float]:
    bounds = [0, *accumulate(sizes)]
    n = len(prefix) - 1
    return [
        prefix[b] - prefix[a] + (cuts[b - 1] if b < n else 0.0) for a, b in zip(bounds, bounds[1:])
    ]


def _step_time_of(prefix: list[float], cuts: list[float], sizes: list[int], m: int) -> float:
    times = _stage_times(prefix, cuts, sizes)
    return (m - 1) * max(times) + math.fsum(times)


def _interval_times(
    prefix: list[float], cuts: list[float], right: list[int], lower: float, upper: float
) -> list[float]:
    """Distinct stage times (cost plus outgoing cut) in ``[lower, upper]``, increasing."""
    n = len(prefix) - 1
    found: set[float] = set()
    for i in range(n):
        last = min(right[i], _reach_right(prefix, i, upper))
        for j in range(i + 1, last + 1):
            t = prefix[j] - prefix[i] + (cuts[j - 1] if j < n else 0.0)
            if lower <= t <= upper:
                found.add(t)
    return sorted(found)


def _least_cuts(
    prefix: list[float], cuts: list[float], left: list[int], stages: int, bound: float
) -> tuple[float, list[int]] | None:
    """Least total cut cost over partitions whose stage times are all <= ``bound``.

    Suffix DP: ``row[i]`` is the least cut cost covering items ``i:`` with ``k`` stages, the
    minimum over ends ``j`` of ``cuts[j - 1] + below[j]``. The stages ending at ``j`` that fit
    start anywhere in ``lo[j]:j`` (time and memory only grow as a stage grows to the left), so
    sweeping ``i`` downwards each end enters a heap once and leaves it for good when ``i``
    drops below ``lo[j]``: ``O(K n log n)``. The heap orders equal costs by end, so each stage
    ends as early as it may (the earliest cuts). None when no partition fits.
    """
    n = len(prefix) - 1
    inf = math.inf
    lo = [0] * (n + 1)  # the earliest start of a stage ending at j; j when none fits
    for j in range(1, n + 1):
        extra = cuts[j - 1] if j < n else 0.0
        lo[j] = max(_reach_left(prefix, j, bound, extra), left[j])
    below = [0.0 if i >= lo[n] and i < n else inf for i in range(n + 1)]
    choices: list[list[int]] = []
    for _ in range(2, stages + 1):
        row = [inf] * (n + 1)
        choice = [0] * (n + 1)
        heap: list[tuple[float, int]] = []
        for i in range(n - 1, -1, -1):
            j = i + 1
            if below[j] < inf and lo[j] <= i:
                heappush(heap, (cuts[j - 1] + below[j], j))
            while heap and lo[heap[0][1]] > i:
                heappop(heap)
            if heap:
                row[i], choice[i] = heap[0]
        choices.append(choice)
        below = row
    if below[0] == inf:
        return None
    sizes: list[int] = []
    i = 0
    for choice in reversed(choices):
        j = choice[i]
        sizes.append(j - i)
        i = j
    sizes.append(n - i)
    return below[0], sizes
