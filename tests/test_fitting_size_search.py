"""memfit.fitting.size_search.largest_fitting, checked against brute force on peaks of known shape,
and the number of plans it makes: four on an affine peak, whatever the answer."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from memfit.fitting.size_search import largest_fitting


def _brute(peak: Callable[[int], int], capacity: int, limit: int) -> int:
    lo, hi = 0, limit + 1  # monotone peaks: bisection is brute force's answer
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if peak(mid) <= capacity:
            lo = mid
        else:
            hi = mid
    return lo


def test_an_affine_peak_takes_at_most_four_plans_for_any_answer() -> None:
    rng = random.Random(0)
    for _ in range(500):
        a, b = rng.randint(0, 10**6), rng.randint(1, 10**4)
        capacity, limit = rng.randint(0, 10**9), rng.choice([10, 1000, 1 << 20])
        calls: list[int] = []

        def peak(size: int, a: int = a, b: int = b, calls: list[int] = calls) -> int:
            calls.append(size)
            return a + b * size

        found = largest_fitting(peak, capacity, start=rng.randint(1, 64), limit=limit)
        assert len(calls) == len(set(calls)) == len(found.planned) <= 4
        assert found.size == _brute(lambda s, a=a, b=b: a + b * s, capacity, limit)
        assert found.exact
        assert found.capped == (found.size == limit)


@pytest.mark.parametrize("shape", ["convex", "kinked", "steps"])
def test_peaks_that_are_not_affine_are_found_exactly(shape: str) -> None:
    rng = random.Random(1)
    for _ in range(200):
        a, b, c = rng.randint(0, 10**6), rng.randint(1, 10**4), rng.randint(1, 5)
        peaks: dict[str, Callable[[int], int]] = {
            # attention quadratic in the sequence
            "convex": lambda s, a=a, b=b, c=c: a + b * s + c * s * s,
            # a plan that changes its decisions at a size
            "kinked": lambda s, a=a, b=b: a + max(b * s, 20 * b + 3 * b * (s - 20)),
            # sizes padded to multiples of 8
            "steps": lambda s, a=a, b=b: a + b * (s // 8 + 1) * 8,
        }
        capacity, limit = rng.randint(0, 10**8), 1 << 16
        found = largest_fitting(
            peaks[shape], capacity, start=rng.randint(1, 64), limit=limit, max_plans=40
        )
        assert found.size == _brute(peaks[shape], capacity, limit)
        assert found.exact


def test_the_answer_and_the_size_after_it_are_planned() -> None:
    found = largest_fitting(lambda s: 100 * s, 1050, start=3)
    assert found.size == 10 and found.exact
    assert dict(found.planned)[10] == 1000 and dict(found.planned)[11] == 1100


def test_nothing_fits_and_the_limit() -> None:
    none = largest_fitting(lambda s: 100 + s, 50, start=8)
    assert none.size == 0 and none.exact and not none.capped
    assert 1 in dict(none.planned)
    capped = largest_fitting(lambda s: s, 10**9, start=4, limit=64)
    assert capped.size == 64 and capped.capped and capped.exact
    assert len(capped.planned) <= 3


def test_a_search_out_of_plans_says_it_is_not_exact() -> None:
    found = largest_fitting(lambda s: s**3, 10**9, start=1, max_plans=3)
    assert not found.exact
    assert found.size**3 <= 10**9 and len(found.planned) == 3
    with pytest.raises(ValueError, match="max_plans >= 2"):
        largest_fitting(lambda s: s, 10, start=1, max_plans=1)
