"""``balance_intervals``: exact for any interval functions, checked against brute force."""

from __future__ import annotations

import itertools
import pickle
import random
import time

import pytest

from memfit.pipeline import CapacityError, balance_intervals, balance_pipeline


def _brute(n, k, m, stage_time, stage_memory=None, capacity=None):
    """Every composition; the least (step, slowest stage, cuts); least capacity if none fits."""
    best, least = None, None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = [0, *cuts, n]
        spans = list(zip(bounds, bounds[1:]))
        times = [stage_time(i, j) for i, j in spans]
        if stage_memory is not None:
            peak = max(stage_memory(s, i, j) for s, (i, j) in enumerate(spans))
            least = peak if least is None else min(least, peak)
            if peak > capacity:
                continue
        key = ((m - 1) * max(times) + sum(times), max(times), cuts)
        if best is None or key < best[0]:
            best = (key, [j - i for i, j in spans])
    return best, least


def _instance(rng: random.Random):
    n = rng.randint(1, 9)
    k = rng.randint(1, min(4, n))
    m = rng.randint(1, 6)
    cost = [rng.randint(0, 9) for _ in range(n)]
    cut = [rng.randint(0, 5) for _ in range(n + 1)]
    extra = {(i, j): rng.randint(0, 3) for i in range(n) for j in range(i + 1, n + 1)}
    size = [rng.randint(1, 9) for _ in range(n)]
    boundary = [rng.randint(0, 4) for _ in range(n + 1)]

    def stage_time(i: int, j: int) -> float:  # additive, plus a cut cost, plus anything
        return sum(cost[i:j]) + (cut[j] if j < n else 0) + extra[i, j]

    def stage_memory(s: int, i: int, j: int) -> float:  # not additive, depends on position
        return max(size[i:j]) + (k - s) * boundary[i]

    return n, k, m, stage_time, stage_memory


def test_optimal_against_brute_force_with_and_without_capacity() -> None:
    rng = random.Random(7)
    infeasible = 0
    for _ in range(300):
        n, k, m, stage_time, stage_memory = _instance(rng)
        best, _ = _brute(n, k, m, stage_time)
        assert balance_intervals(n, k, microbatches=m, stage_time=stage_time) == best[1]
        capacity = rng.randint(3, 30)
        best, least = _brute(n, k, m, stage_time, stage_memory, capacity)
        if best is None:
            infeasible += 1
            with pytest.raises(CapacityError) as info:
                balance_intervals(
                    n,
                    k,
                    microbatches=m,
                    stage_time=stage_time,
                    stage_memory=stage_memory,
                    capacity=capacity,
                )
            assert info.value.least_capacity == least
        else:
            got = balance_intervals(
                n,
                k,
                microbatches=m,
                stage_time=stage_time,
                stage_memory=stage_memory,
                capacity=capacity,
            )
            assert got == best[1]
    assert 20 < infeasible < 280  # both branches exercised


def test_additive_costs_give_balance_pipelines_partition() -> None:
    rng = random.Random(3)
    for _ in range(50):
        n = rng.randint(2, 30)
        k = rng.randint(1, min(6, n))
        m = rng.randint(1, 8)
        costs = [rng.randint(1, 20) for _ in range(n)]
        cuts = [rng.randint(0, 6) for _ in range(n - 1)]

        def stage_time(
            i: int, j: int, costs: list[int] = costs, cuts: list[int] = cuts, n: int = n
        ) -> float:
            return sum(costs[i:j]) + (cuts[j - 1] if j < n else 0)

        expected = balance_pipeline(costs, k, microbatches=m, cut_costs=cuts)
        assert balance_intervals(n, k, microbatches=m, stage_time=stage_time) == expected


def test_bad_input_is_refused() -> None:
    def one(i: int, j: int) -> float:
        return 1.0

    with pytest.raises(ValueError, match="stages"):
        balance_intervals(3, 4, microbatches=1, stage_time=one)
    with pytest.raises(ValueError, match="microbatches"):
        balance_intervals(3, 2, microbatches=0, stage_time=one)
    with pytest.raises(ValueError, match="together"):
        balance_intervals(3, 2, microbatches=1, stage_time=one, capacity=5.0)
    with pytest.raises(ValueError, match=r"stage_time\(0, 1\)"):
        balance_intervals(3, 2, microbatches=1, stage_time=lambda i, j: float("nan"))


def test_two_hundred_items_in_sixteen_stages_is_quick() -> None:
    rng = random.Random(0)
    costs = [rng.random() for _ in range(200)]
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    start = time.perf_counter()
    sizes = balance_intervals(
        200, 16, microbatches=8, stage_time=lambda i, j: prefix[j] - prefix[i] + 0.01
    )
    assert sum(sizes) == 200 and len(sizes) == 16
    assert time.perf_counter() - start < 30  # generous: a hang or a blow-up fails, noise not


def test_one_micro_batch_stops_at_the_least_sum_and_the_error_pickles() -> None:
    rng = random.Random(1)
    costs = [rng.random() for _ in range(200)]
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    start = time.perf_counter()
    sizes = balance_intervals(
        200, 16, microbatches=1, stage_time=lambda i, j: prefix[j] - prefix[i]
    )
    assert len(sizes) == 16 and time.perf_counter() - start < 10  # every bound took 25 s
    error = pickle.loads(pickle.dumps(CapacityError("no fit", 12.5)))
    assert isinstance(error, CapacityError) and error.least_capacity == 12.5
