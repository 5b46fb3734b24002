"""The largest size (batch, sequence length) whose predicted step peak fits, in a few plans.

Why not double and bisect, as ``memfit profile`` does with real steps: each probe here is a
plan, and a plan's cost grows with nothing but the graph, so the number of plans must not grow
with the answer either. A step's peak is close to affine in the batch (every activation has the
batch as a factor; weights and optimizer state have none), so the search plans two sizes, solves
the line through them for the capacity, and plans the answer and the size after it directly
(secant steps, the newest two points each time): on an affine peak that is four plans for any
answer. A peak that is not affine (a plan that changes its decisions with the size, attention
quadratic in the sequence) takes more secant steps; each step stays strictly inside the bracket
of the largest size known to fit and the smallest known not to, falling back to its middle when
the secant leaves it, and after ``max_plans`` the search stops with ``exact=False``.

The answer is only ever a size that was planned and fitted, and ``exact`` means the next size
was planned and did not: both sides are verified by a plan, not read off the line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["SizeSearch", "largest_fitting"]


@dataclass(frozen=True)
class SizeSearch:
    """What ``largest_fitting`` found."""

    #: the largest size planned that fits (0: not even size 1)
    size: int
    #: ``size + 1`` was planned and does not fit (or ``size`` is the limit: ``capped``)
    exact: bool
    #: ``size`` is ``limit`` and fits: larger sizes were not tried
    capped: bool
    #: every size planned, in order, with its predicted peak
    planned: tuple[tuple[int, int], ...]


def _secant(a: tuple[int, int], b: tuple[int, int], capacity: int) -> float | None:
    """Where the line through ``a`` and ``b`` (size, peak) reaches ``capacity``; None when flat."""
    (s1, p1), (s2, p2) = a, b
    if s1 == s2 or p1 == p2:
        return None
    return s1 + (capacity - p1) * (s2 - s1) / (p2 - p1)


def largest_fitting(
    peak_at: Callable[[int], int],
    capacity: int,
    *,
    start: int,
    limit: int = 1 << 20,
    max_plans: int = 10,
) -> SizeSearch:
    """The largest ``size`` in ``[1, limit]`` with ``peak_at(size) <= capacity``.

    ``peak_at`` plans one size and returns its predicted peak; it is called at most
    ``max_plans`` times, each size once. ``start`` is the first size planned (the size the user
    asked about). Assumes the peak grows with the size; see the module docstring.
    """
    if limit < 1 or max_plans < 2:
        raise ValueError(f"need limit >= 1 and max_plans >= 2, got {limit}, {max_plans}")
    known: dict[int, int] = {}
    order: list[int] = []

    def plan(size: int) -> bool:
        if size not in known:
            known[size] = peak_at(size)
            order.append(size)
        return known[size] <= capacity

    first = min(max(start, 1), limit)
    lo, hi = 0, limit + 1  # lo fits (0: none known), hi does not (limit + 1: none known)
    if plan(first):
        lo = first
        second = min(2 * first, limit)
    else:
        hi = first
        second = max(first // 2, 1)
    if second != first:
        if plan(second):
            lo = max(lo, second)
        else:
            hi = min(hi, second)
    while hi - lo > 1 and len(order) < max_plans:
        a, b = (order[-2], known[order[-2]]), (order[-1], known[order[-1]])
        guess = _secant(a, b, capacity)
        grow = (lo + hi) // 2 if hi <= limit else min(2 * max(lo, 1), limit)
        target = grow if guess is None else int(guess // 1)
        if target <= lo:
            target = lo + 1  # the line says lo or less: plan the size after lo
        elif target >= hi:
            target = limit if hi > limit else grow  # beyond the limit: plan the limit
        if plan(target):
            lo = target
        else:
            hi = target
    capped = lo == limit
    return SizeSearch(
        size=lo,
        exact=hi - lo <= 1 or capped,
        capped=capped,
        planned=tuple((s, known[s]) for s in order),
    )
