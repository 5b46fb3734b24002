"""Exact stage balance when a stage's time and memory are any functions of its items.

``balancing.balance_pipeline`` needs additive costs: a stage's memory the sum of
its items'. A real stage is not additive: its parameters are a union (a tied weight read twice
is held once), it holds what crosses its incoming cut once per micro-batch in flight (``M``
under GPipe, ``K - s`` under 1F1B, so the same items cost different memory in different stage
positions), and its recomputation transient is that of its whole span. So the planner searches
over arbitrary interval functions, on the modest number of candidate cuts a captured model has
(module boundaries, at most a few hundred):

    minimise  T = (M - 1) * max_s t_s + sum_s t_s   over contiguous stages [i_s, j_s)
    subject   memory(s, i_s, j_s) <= capacity        for every stage s

The optimum's slowest stage ``B`` is one of the interval times. For a bound ``B``, a DP over
(stage, end) finds the least ``sum_s t_s`` with every stage within ``B`` and the capacity
(``O(K n^2)``, vectorised over the start); then ``T(B) = (M - 1) * B + that sum`` bounds the
true step of the partition found from above, and is exact at the optimum's own ``B``, so the
least ``T(B)`` over candidate bounds is the optimum. Bounds are tried in increasing order from
the least feasible one (found by bisection), and the walk stops once ``(M - 1) * B`` plus the
least sum any partition has cannot beat the best found, or once the sum within the bound is that
least sum (no larger bound can lower it): with small transfer costs that is after a few bounds;
the worst case tries all ``O(n^2)`` interval times (``O(K n^4)``).

Ties: the smallest slowest stage among equal step times, then the earliest cuts (the
lexicographically smallest cut positions), as in ``balancing``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

__all__ = ["CapacityError", "balance_intervals", "interval_step_time"]

#: relative slack when comparing sums reached in different orders (float rounding)
_TOLERANCE = 1e-12


class CapacityError(ValueError):
    """No partition fits the capacity; ``least_capacity`` is the smallest capacity one fits."""

    def __init__(self, message: str, least_capacity: float) -> None:
        super().__init__(message)
        self.least_capacity = least_capacity

    def __reduce__(self) -> tuple[type, tuple[str, float]]:
        # keep least_capacity when the error is pickled (between processes, by any caller)
        return (type(self), (str(self), self.least_capacity))


def _check(n: int, stages: int, microbatches: int) -> None:
    for name, value, least in (
        ("n", n, 1),
        ("stages", stages, 1),
        ("microbatches", microbatches, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    if stages > n:
        raise ValueError(f"stages ({stages}) > items ({n}): every stage needs at least one item")


def _value(name: str, v: float, where: str) -> float:
    f = float(v)
    if not math.isfinite(f) or f < 0:
        raise ValueError(f"{name}{where} is {v!r}; it must be finite and >= 0")
    return f


def _times(n: int, stage_time: Callable[[int, int], float]) -> np.ndarray:
    times = np.full((n + 1, n + 1), np.inf)
    for i in range(n):
        for j in range(i + 1, n + 1):
            times[i, j] = _value("stage_time", stage_time(i, j), f"({i}, {j})")
    return times


def _memory(n: int, stages: int, stage_memory: Callable[[int, int, int], float]) -> np.ndarray:
    memory = np.full((stages, n + 1, n + 1), np.inf)
    for s in range(stages):
        # stage s starts after s items and leaves one item for each later stage
        for i in range(s, n - (stages - 1 - s)):
            for j in range(i + 1, n - (stages - 1 - s) + 1):
                memory[s, i, j] = _value("stage_memory", stage_memory(s, i, j), f"({s}, {i}, {j})")
    return memory


def _least_sums(times: np.ndarray, allowed: np.ndarray, stages: int) -> np.ndarray:
    """``R[s, i]``: least summed time of stages ``s..K-1`` covering items ``[i, n)``."""
    n = times.shape[0] - 1
    rest = np.full((stages + 1, n + 1), np.inf)
    rest[stages, n] = 0.0
    for s in range(stages - 1, -1, -1):
        cost = np.where(allowed[s], times, np.inf) + rest[s + 1][None, :]
        rest[s] = cost.min(axis=1)
    return rest


def _earliest(times: np.ndarray, allowed: np.ndarray, rest: np.ndarray, stages: int) -> list[int]:
    """Sizes of a least-sum partition with the earliest cuts, read off ``rest``."""
    n = times.shape[0] - 1
    sizes, i = [], 0
    for s in range(stages):
        target = rest[s, i]
        for j in range(i + 1, n + 1):
            if not allowed[s, i, j]:
                continue
            total = times[i, j] + rest[s + 1, j]
            if total <= target + _TOLERANCE * max(1.0, abs(target)):
                sizes.append(j - i)
                i = j
                break
    return sizes


def interval_step_time(
    sizes: list[int], stage_time: Callable[[int, int], float], microbatches: int
) -> float:
    """``(M - 1) * max_s t_s + sum_s t_s`` of the partition ``sizes``."""
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    times = [float(stage_time(i, j)) for i, j in zip(bounds, bounds[1:])]
    return (microbatches - 1) * max(times) + sum(times)


def _least_bottleneck(values: np.ndarray, fits: Callable[[float], bool]) -> float:
    """The smallest of the sorted ``values`` for which ``fits`` holds (it is monotone)."""
    low, high = 0, len(values) - 1
    while low < high:
        mid = (low + high) // 2
        if fits(float(values[mid])):
            high = mid
        else:
            low = mid + 1
    return float(values[low])


def balance_intervals(
    n: int,
    stages: int,
    *,
    microbatches: int,
    stage_time: Callable[[int, int], float],
    stage_memory: Callable[[int, int, int], float] | None = None,
    capacity: float | None = None,
) -> list[int]:
    """Sizes of ``stages`` contiguous stages over ``n`` items minimising the predicted step.

    ``stage_time(i, j)``: time per micro-batch of a stage holding items ``[i, j)`` (its
    outgoing transfer included, if any); ``stage_memory(s, i, j)``: predicted peak of stage
    ``s`` holding them, which must be within ``capacity`` (give both or neither). Exact; see
    the module docstring. Raises :class:`CapacityError` (a ``ValueError``) naming the smallest
    capacity any partition fits when none fits ``capacity``.
    """
    _check(n, stages, microbatches)
    if (stage_memory is None) != (capacity is None):
        raise ValueError("give stage_memory and capacity together (or neither)")
    times = _times(n, stage_time)
    finite = np.isfinite(times)
    if stage_memory is not None and capacity is not None:
        memory = _memory(n, stages, stage_memory)
        fitting = memory <= capacity
        if not _reachable(fitting & finite[None], stages):
            values = np.unique(memory[np.isfinite(memory)])
            least = _least_bottleneck(
                values, lambda c: _reachable((memory <= c) & finite[None], stages)
            )
            raise CapacityError(
                f"no partition into {stages} stages fits capacity {capacity:g}; "
                f"the smallest capacity that fits is {least:g}",
                least,
            )
    else:
        fitting = np.ones((stages, n + 1, n + 1), dtype=bool)
    allowed = fitting & finite[None]
    bounds = np.unique(times[finite & allowed.any(axis=0)])
    first = _least_bottleneck(bounds, lambda b: _reachable(allowed & (times <= b)[None], stages))
    least_sum = float(_least_sums(times, allowed, stages)[0, 0])
    best: tuple[float, float, list[int]] | None = None
    for bound in bounds[bounds >= first]:
        bound = float(bound)
        if best is not None:
            floor = (microbatches - 1) * bound + least_sum
            if floor > best[0] + _TOLERANCE * max(1.0, best[0]):
                break
        within = allowed & (times <= bound)[None]
        rest = _least_sums(times, within, stages)
        if not math.isfinite(rest[0, 0]):
            continue
        total = float(rest[0, 0])
        step = (microbatches - 1) * bound + total
        if best is None or step < best[0] - _TOLERANCE * max(1.0, best[0]):
            best = (step, bound, _earliest(times, within, rest, stages))
        if total <= least_sum + _TOLERANCE * max(1.0, least_sum):
            break  # larger bounds cannot lower the sum, only raise (M - 1) * bound
    assert best is not None  # the least feasible bound has a partition
    return best[2]


def _reachable(allowed: np.ndarray, stages: int) -> bool:
    """Whether some partition uses only allowed ``(stage, start, end)`` intervals."""
    n = allowed.shape[1] - 1
    at = np.zeros(n + 1, dtype=bool)
    at[0] = True
    for s in range(stages):
        at = (at[:, None] & allowed[s]).any(axis=0)
    return bool(at[n])
