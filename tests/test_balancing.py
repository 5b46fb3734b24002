"""memfit.pipeline.balancing: exact stage balance, checked against brute force over compositions.

The oracle enumerates every partition of a short chain into ``K`` contiguous non-empty stages
(all compositions), so optimality, the tie rule (earliest cuts) and the capacity error's
smallest feasible capacity are checked on each random case, not asserted from hand-picked
numbers; a few literal cases pin the documented behaviour.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator, Sequence

import pytest

from memfit.pipeline import balance_pipeline, pipeline_step_time


def compositions(n: int, k: int) -> Iterator[list[int]]:
    """Every way to cut ``n`` items into ``k`` contiguous non-empty stages, as sizes."""
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = [0, *cuts, n]
        yield [b - a for a, b in zip(bounds, bounds[1:])]


def sums(values: Sequence[float], sizes: Sequence[int]) -> list[float]:
    out, i = [], 0
    for size in sizes:
        out.append(math.fsum(values[i : i + size]))
        i += size
    return out


def least_slowest(
    costs: Sequence[float],
    k: int,
    *,
    memory: Sequence[float] | None = None,
    capacity: float | None = None,
) -> list[int]:
    """``balance_pipeline`` without cut costs: the partition with the least slowest stage (the
    search's start and lower bound; any ``M`` gives it)."""
    return balance_pipeline(costs, k, microbatches=2, memory=memory, capacity=capacity)


def step_time(
    costs: Sequence[float], sizes: Sequence[int], m: int, cuts: Sequence[float]
) -> tuple[float, float]:
    """(GPipe step time, slowest stage), each stage paying its outgoing cut."""
    ends = list(itertools.accumulate(sizes))
    times = [s + (cuts[e - 1] if e < len(costs) else 0.0) for s, e in zip(sums(costs, sizes), ends)]
    return (m - 1) * max(times) + math.fsum(times), max(times)


def random_case(
    rng: random.Random, integers: bool, with_memory: bool
) -> tuple[list[float], int, list[float] | None, float | None]:
    n = rng.randint(1, 9)
    k = rng.randint(1, n)
    costs = [float(rng.randint(0, 9)) if integers else rng.uniform(0, 10) for _ in range(n)]
    if not with_memory:
        return costs, k, None, None
    memory = [float(rng.randint(0, 9)) for _ in range(n)]
    return costs, k, memory, float(rng.randint(0, 30))


def feasible(n: int, k: int, memory: list[float] | None, capacity: float | None) -> list[list[int]]:
    return [
        s
        for s in compositions(n, k)
        if memory is None or capacity is None or max(sums(memory, s)) <= capacity
    ]


# ------------------------------------------------------------------------------ literal cases


def test_literal_partitions() -> None:
    assert least_slowest([1, 1, 1, 1, 4], 2) == [4, 1]
    assert least_slowest([5], 1) == [1]
    assert least_slowest([2, 2, 2, 2], 4) == [1, 1, 1, 1]
    assert least_slowest([3, 1, 2], 2) == [1, 2]
    # seven equal items, three stages of at most 3: ties go to the earliest cuts
    assert least_slowest([1] * 7, 3) == [1, 3, 3]
    assert least_slowest([0, 0, 0], 2) == [1, 2]


def test_literal_memory() -> None:
    # unconstrained, the last item stands alone; at most three items per stage it cannot
    assert least_slowest([1, 1, 1, 1, 4], 2, memory=[1] * 5, capacity=3) == [3, 2]
    assert least_slowest([4, 1, 1, 1, 1], 2) == [1, 4]
    assert least_slowest([4, 1, 1, 1, 1], 2, memory=[1] * 5, capacity=3) == [2, 3]
    # memory can force a stage past the cost optimum
    assert least_slowest([1, 1, 1, 1], 2, memory=[3, 0, 0, 0], capacity=3) == [2, 2]
    assert least_slowest([1, 1, 1, 1], 2, memory=[3, 1, 0, 0], capacity=3) == [1, 3]


def test_literal_step_time() -> None:
    # stages 1+2+3 (+ cut 1) and 4: (4 - 1) * 7 + (7 + 4)
    assert pipeline_step_time([1, 2, 3, 4], [3, 1], microbatches=4, cut_costs=[0, 0, 1]) == 32.0
    assert pipeline_step_time([1, 2, 3, 4], [3, 1], microbatches=1) == 10.0


def test_literal_pipeline() -> None:
    # the even split pays the one dear cut: 3 * (2 + 10) + 14 = 50; [1, 3] and [3, 1] take
    # 3 * 3 + 4 = 13 with the same slowest stage, so the earlier cut wins
    costs = [1.0, 1.0, 1.0, 1.0]
    assert least_slowest(costs, 2) == [2, 2]
    assert balance_pipeline(costs, 2, microbatches=4, cut_costs=[0, 10, 0]) == [1, 3]
    assert balance_pipeline(costs, 2, microbatches=4) == [2, 2]
    # one micro-batch: no pipelining, only the cut's cost matters
    assert balance_pipeline(costs, 2, microbatches=1, cut_costs=[3, 1, 2]) == [2, 2]
    assert balance_pipeline(costs, 2, microbatches=1, cut_costs=[1, 3, 2]) == [1, 3]
    # many micro-batches: the cut that would even the stages costs more than the imbalance
    six = [1.0] * 6
    assert least_slowest(six, 2) == [3, 3]
    assert balance_pipeline(six, 2, microbatches=64, cut_costs=[0, 0, 3, 0, 0]) == [2, 4]
    # one micro-batch, a free cut at the end: the cut decides alone
    assert balance_pipeline(six, 2, microbatches=1, cut_costs=[9, 9, 1, 9, 0]) == [5, 1]
    # all free but the first cut: the earliest free cuts
    assert balance_pipeline([0] * 5, 3, microbatches=1, cut_costs=[1, 0, 0, 0]) == [2, 1, 2]


# ---------------------------------------------------------------------- against brute force


@pytest.mark.parametrize("with_memory", [False, True])
def test_least_slowest_is_optimal(with_memory: bool) -> None:
    rng = random.Random(1 + with_memory)
    checked = 0
    for trial in range(400):
        integers = trial % 2 == 0
        costs, k, memory, capacity = random_case(rng, integers, with_memory)
        options = feasible(len(costs), k, memory, capacity)
        if not options:
            continue  # the error cases have their own test
        got = least_slowest(costs, k, memory=memory, capacity=capacity)
        assert got in options, (costs, k, memory, capacity, got)
        best = min(max(sums(costs, s)) for s in options)
        assert max(sums(costs, got)) == pytest.approx(best, rel=1e-12, abs=1e-12)
        if integers:  # exact sums: the tie rule is checked too
            earliest = min(
                (s for s in options if max(sums(costs, s)) == best),
                key=lambda s: list(itertools.accumulate(s)),
            )
            assert got == earliest, (costs, k, memory, capacity)
        checked += 1
    assert checked > 200


@pytest.mark.parametrize("with_memory", [False, True])
def test_balance_pipeline_is_optimal(with_memory: bool) -> None:
    rng = random.Random(11 + with_memory)
    checked = 0
    for trial in range(400):
        integers = trial % 2 == 0
        costs, k, memory, capacity = random_case(rng, integers, with_memory)
        options = feasible(len(costs), k, memory, capacity)
        if not options:
            continue
        m = rng.randint(1, 6)
        cuts = [float(rng.randint(0, 5)) if integers else rng.uniform(0, 3) for _ in costs[1:]]
        got = balance_pipeline(
            costs, k, microbatches=m, cut_costs=cuts, memory=memory, capacity=capacity
        )
        assert got in options
        best = min(step_time(costs, s, m, cuts) for s in options)
        assert pipeline_step_time(costs, got, microbatches=m, cut_costs=cuts) == pytest.approx(
            best[0], rel=1e-9
        )
        if integers:  # least time, then the smallest slowest stage, then the earliest cuts
            first = min(
                options,
                key=lambda s: (*step_time(costs, s, m, cuts), list(itertools.accumulate(s))),
            )
            assert got == first, (costs, k, m, cuts, memory, capacity)
        checked += 1
    assert checked > 200


def test_balance_pipeline_without_cut_costs_is_the_same_for_every_m() -> None:
    rng = random.Random(5)
    for _ in range(100):
        costs, k, memory, capacity = random_case(rng, rng.random() < 0.5, True)
        if not feasible(len(costs), k, memory, capacity):
            continue
        m = rng.randint(1, 8)
        assert balance_pipeline(
            costs, k, microbatches=m, memory=memory, capacity=capacity
        ) == least_slowest(costs, k, memory=memory, capacity=capacity)


def test_capacity_error_names_the_smallest_feasible_capacity() -> None:
    rng = random.Random(7)
    raised = 0
    for _ in range(300):
        costs, k, memory, capacity = random_case(rng, True, True)
        assert memory is not None and capacity is not None
        if feasible(len(costs), k, memory, capacity):
            continue
        need = min(max(sums(memory, s)) for s in compositions(len(costs), k))
        with pytest.raises(ValueError) as info:
            balance_pipeline(costs, k, microbatches=2, memory=memory, capacity=capacity)
        message = str(info.value)
        assert f"smallest capacity that fits {k} stages is {need!r}" in message
        assert f"capacity ({capacity!r})" in message
        # and that capacity does fit
        assert max(sums(memory, least_slowest(costs, k, memory=memory, capacity=need))) <= need
        raised += 1
    assert raised > 30


# -------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"costs": [1, 2], "stages": 0}, r"stages must be >= 1, got 0"),
        ({"costs": [1, 2], "stages": 3}, r"stages \(3\) > number of items \(2\)"),
        ({"costs": [1, 2], "stages": 1.5}, r"stages must be an int, got 1.5"),
        ({"costs": [], "stages": 1}, r"costs is empty"),
        ({"costs": [1, -2], "stages": 1}, r"costs\[1\] is -2; costs must be finite and >= 0"),
        ({"costs": [1, math.nan], "stages": 1}, r"costs\[1\] is nan"),
        ({"costs": [math.inf], "stages": 1}, r"costs\[0\] is inf"),
        ({"costs": ["1"], "stages": 1}, r"costs\[0\] must be a number, got '1'"),
        ({"costs": [1e308, 1e308], "stages": 1}, r"costs sum past the largest float"),
        (
            {"costs": [1, 2], "stages": 1, "memory": [1, 1]},
            r"memory was given without capacity",
        ),
        (
            {"costs": [1, 2], "stages": 1, "capacity": 5},
            r"capacity \(5\) was given without memory",
        ),
        (
            {"costs": [1, 2], "stages": 1, "memory": [1], "capacity": 5},
            r"memory has 1 values but costs has 2",
        ),
        (
            {"costs": [1, 2], "stages": 1, "memory": [1, -1], "capacity": 5},
            r"memory\[1\] is -1",
        ),
        (
            {"costs": [1, 2], "stages": 1, "memory": [1, 1], "capacity": math.inf},
            r"capacity must be a finite number >= 0, got inf",
        ),
        (
            {"costs": [1, 2, 3], "stages": 2, "memory": [4, 1, 1], "capacity": 3},
            r"item 0 alone needs 4.0.*smallest capacity that fits 2 stages is 4.0",
        ),
    ],
)
def test_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        balance_pipeline(**kwargs, microbatches=4)  # type: ignore[arg-type]


def test_pipeline_errors() -> None:
    with pytest.raises(ValueError, match=r"microbatches must be an int >= 1, got 0"):
        balance_pipeline([1, 2], 1, microbatches=0)
    with pytest.raises(ValueError, match=r"cut_costs has 2 values but 2 items have 1 places"):
        balance_pipeline([1, 2], 1, microbatches=2, cut_costs=[1, 1])
    with pytest.raises(ValueError, match=r"cut_costs\[0\] is -1"):
        balance_pipeline([1, 2], 1, microbatches=2, cut_costs=[-1])
    with pytest.raises(ValueError, match=r"sizes sum to 3 but there are 2 values"):
        pipeline_step_time([1, 2], [1, 2], microbatches=1)
    with pytest.raises(ValueError, match=r"sizes\[1\] is 0; stage sizes must be ints >= 1"):
        pipeline_step_time([1, 2], [2, 0], microbatches=1)


# ---------------------------------------------------------------------------------------- scale


def valid(sizes: list[int], n: int, k: int) -> bool:
    return len(sizes) == k and sum(sizes) == n and min(sizes) >= 1


def test_ten_thousand_items_sixty_four_stages() -> None:
    rng = random.Random(3)
    costs = [rng.uniform(0, 1) for _ in range(10_000)]
    memory = [rng.uniform(0, 1) for _ in range(10_000)]
    sizes = least_slowest(costs, 64)
    assert valid(sizes, 10_000, 64)
    # no stage can be cheaper than the average, nor an optimal one dearer than average + item
    assert sum(costs) / 64 <= max(sums(costs, sizes)) <= sum(costs) / 64 + max(costs) + 1e-9
    capped = least_slowest(costs, 64, memory=memory, capacity=100.0)
    assert valid(capped, 10_000, 64)
    assert max(sums(memory, capped)) <= 100.0 + 1e-9
    assert max(sums(costs, capped)) >= max(sums(costs, sizes)) - 1e-9
    assert balance_pipeline(costs, 64, microbatches=8) == sizes  # the same for every M


def test_pipeline_with_cut_costs_on_a_few_hundred_items() -> None:
    rng = random.Random(4)
    costs = [rng.uniform(0, 1) for _ in range(300)]
    cuts = [rng.uniform(0, 0.5) for _ in range(299)]
    sizes = balance_pipeline(costs, 8, microbatches=8, cut_costs=cuts)
    assert valid(sizes, 300, 8)
    # never slower than the partition that ignores the cuts
    plain = least_slowest(costs, 8)
    assert pipeline_step_time(costs, sizes, microbatches=8, cut_costs=cuts) <= pipeline_step_time(
        costs, plain, microbatches=8, cut_costs=cuts
    )
