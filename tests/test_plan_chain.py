"""planning.plan_chain: the segment rule, the simulated step peak it leads to, and its choice."""

from __future__ import annotations

import math

from memfit.planning.plan_chain import (
    KEEP_ALL,
    ChainPlan,
    ChainRun,
    ChainValue,
    choose,
    segments_of,
    simulate,
    summary,
)

MiB = 2**20


def _tanh_chain(n: int) -> tuple[list[ChainRun], list[ChainValue]]:
    """A chain of ``n`` equal runs, each saving its 1 MiB input for its backward (which then
    needs 2 MiB more), made by the run before: the shape of a layer per graph."""
    runs = [
        ChainRun(
            key="layer",
            forward_peak=MiB,
            backward_peak=3 * MiB,
            kept=0,
            parameter_grads=0,
            forward_flops=1000,
            output_bytes=MiB,
        )
        for _ in range(n)
    ]
    values = [ChainValue(i, MiB, readers=(i + 1,), savers=(i + 1,)) for i in range(n - 1)]
    values.append(ChainValue(n - 1, MiB, pinned=True))  # the step's output
    return runs, values


def test_keeping_everything_holds_every_value_until_its_backward() -> None:
    runs, values = _tanh_chain(10)
    peak, held = simulate(runs, values, [])
    # nine saved inputs and the output held, then the last backward's 3 MiB beside eight
    assert held == 10 * MiB
    assert peak == 9 * MiB + 3 * MiB - MiB + MiB  # the output is let go as its backward starts


def test_a_chain_of_n_layers_is_cut_into_about_sqrt_n_segments_within_the_sqrt_bound() -> None:
    n = 100
    runs, values = _tanh_chain(n)
    plan = choose(runs, values)
    segments = segments_of(runs, plan)
    keep_all, _ = simulate(runs, values, [])
    peak, _ = simulate(runs, values, segments)
    assert 5 <= len(segments) <= 20  # ~sqrt(100)
    assert peak <= (2.5 * math.sqrt(n) + 3) * MiB
    assert peak < keep_all / 4
    # every run replayed once: the segments cover the chain without overlap
    covered = [i for first, last in segments for i in range(first, last + 1)]
    assert covered == list(range(n))


def test_nothing_is_dropped_where_dropping_does_not_lower_the_peak() -> None:
    runs, values = _tanh_chain(2)
    assert choose(runs, values) == KEEP_ALL
    assert segments_of(runs, KEEP_ALL) == []


def test_a_budget_takes_the_fewest_replays_that_fit_and_the_least_peak_where_none_does() -> None:
    runs, values = _tanh_chain(36)
    least = choose(runs, values)
    least_peak, _ = simulate(runs, values, segments_of(runs, least))
    keep_all, _ = simulate(runs, values, [])
    budget = (least_peak + keep_all) // 2
    plan = choose(runs, values, budget)
    peak, _ = simulate(runs, values, segments_of(runs, plan))
    assert peak <= budget
    # the same or fewer runs replayed than "memory"'s rule, which reaches lower
    assert summary(runs, values, segments_of(runs, plan)).replayed <= 36
    assert choose(runs, values, keep_all) == KEEP_ALL
    assert choose(runs, values, least_peak - 1) == least  # nothing fits: the least peak


def test_a_run_that_cannot_be_dropped_ends_the_open_segment() -> None:
    runs, _ = _tanh_chain(6)
    runs[3] = ChainRun("offloads", MiB, 2 * MiB, 0, 0, 10, MiB, droppable=False)
    assert segments_of(runs, ChainPlan(1)) == [(0, 0), (1, 1), (2, 2), (4, 4), (5, 5)]
    assert segments_of(runs, ChainPlan(10 * MiB)) == [(0, 2), (4, 5)]


def test_a_value_entering_a_segment_from_outside_is_held_and_one_inside_is_made_again() -> None:
    runs, values = _tanh_chain(4)
    # segments (0, 1) and (2, 3): value 1 enters the second, values 0 and 2 stay inside one
    _, held = simulate(runs, values, [(0, 1), (2, 3)])
    assert held == MiB + MiB  # value 1, and the pinned output
    # a value code outside memfit's graphs holds is held whatever is dropped
    pinned = [ChainValue(v.producer, v.nbytes, v.readers, v.savers, pinned=True) for v in values]
    _, held_pinned = simulate(runs, pinned, [(0, 1), (2, 3)])
    assert held_pinned == 4 * MiB
