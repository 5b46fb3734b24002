"""The search over headroom among compiled, measured plans (``planning.measured_search``),
on a literal frontier whose "measurement" is its simulation scaled: checked against brute force."""

from __future__ import annotations

import dataclasses

import pytest

from memfit.planning.budget import BudgetError
from memfit.planning.decision import Decision
from memfit.planning.measured_search import Tried, search_plans
from memfit.planning.plan import GraphPlan

#: simulated peaks 100, 110, ..., 200; the cost falls as the peak rises
FRONTIER = [(100 + 10 * i, float(10 - i)) for i in range(11)]


def _plan(peak: int, cost: float) -> GraphPlan:
    return GraphPlan(
        policy="budget",
        decisions={f"kept_{peak}": Decision.KEEP},
        kept=(),
        recomputed=(),
        kept_bytes=0,
        predicted_peak_bytes=peak,
        baseline_peak_bytes=200,
        baseline_kept_bytes=0,
        recompute_flops=int(100 * cost),
        forward_flops=1000,
        num_nodes=0,
        recompute_seconds=cost,
    )


def _planner(budget: int):
    def plan(headroom: int) -> GraphPlan:
        fits = [(p, c) for p, c in FRONTIER if p <= budget - headroom]
        if not fits:
            raise BudgetError("nothing fits", budget_bytes=budget, least_bytes=100)
        return _plan(*min(fits, key=lambda pc: pc[1]))

    return plan


def _measured(ratio: float, calls: list[int]):
    def measured(plan: GraphPlan) -> Tried[None]:
        calls.append(plan.predicted_peak_bytes)
        peak = int(plan.predicted_peak_bytes * ratio)
        return Tried(dataclasses.replace(plan, predicted_peak_bytes=peak), None)

    return measured


def _search(ratio: float, budget: int, tries: int, **kw):
    calls: list[int] = []
    plan = _planner(budget)
    done, limit = search_plans(plan(0), _measured(ratio, calls), plan, budget, tries=tries, **kw)
    return done, limit, calls


def _chosen(done, limit):
    fits = [t.plan for t in done if t.plan.predicted_peak_bytes <= limit]
    return min(fits, key=lambda p: p.cost_seconds) if fits else None


@pytest.mark.parametrize("ratio", [0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3])
@pytest.mark.parametrize("budget", [120, 150, 175])
def test_never_more_than_tries_never_a_plan_twice_and_never_worse_than_the_first(
    ratio: float, budget: int
) -> None:
    done, limit, calls = _search(ratio, budget, tries=4)
    assert 1 <= len(done) <= 4
    assert len(set(calls)) == len(calls)
    first = done[0].plan
    chosen = _chosen(done, limit)
    if first.predicted_peak_bytes <= budget:
        assert chosen is not None and chosen.cost_seconds <= first.cost_seconds


@pytest.mark.parametrize("ratio", [0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3])
@pytest.mark.parametrize("budget", [120, 150, 175])
def test_given_enough_tries_the_cheapest_plan_that_fits_measured_is_found(
    ratio: float, budget: int
) -> None:
    done, limit, _ = _search(ratio, budget, tries=len(FRONTIER))
    best = [(p, c) for p, c in FRONTIER if int(p * ratio) <= budget]
    chosen = _chosen(done, limit)
    if not best:
        assert chosen is None
    else:
        assert chosen is not None and chosen.cost_seconds == min(c for _, c in best)


def test_an_exact_simulation_compiles_once() -> None:
    done, _, calls = _search(1.0, 150, tries=4)
    assert calls == [150]


def test_an_overstating_simulation_gives_the_shortfall_back_then_bisects() -> None:
    # 150 measures 120 (fits, 30 short) -> 180 measures 144 (fits, 36 short) -> 200 measures
    # 160 (over) -> between the two headrooms: 190 measures 152 (over)
    _, _, calls = _search(0.8, 150, tries=4)
    assert calls == [150, 180, 200, 190]


def test_an_understating_simulation_takes_the_excess_off_then_bisects() -> None:
    # 150 measures 180 (over by 30) -> 110 measures 132 (fits) -> 130 measures 156 (over) ->
    # 120 measures 144 (fits): the cheapest that fits
    done, limit, calls = _search(1.2, 150, tries=4)
    assert calls == [150, 110, 130, 120]
    assert _chosen(done, limit).predicted_peak_bytes == 144


def test_at_least_peak_holds_cheaper_plans_to_the_first_measured_peak() -> None:
    calls: list[int] = []
    plan = _planner(100)  # "memory": the least simulated peak, 100
    (
        done,
        limit,
    ) = search_plans(plan(0), _measured(0.9, calls), plan, None, tries=4, at_least_peak=True)
    assert limit == 90
    assert all(t.plan.predicted_peak_bytes >= 90 for t in done)
    assert _chosen(done, limit).predicted_peak_bytes == 90


def test_no_limit_compiles_once() -> None:
    calls: list[int] = []
    plan = _planner(150)
    done, limit = search_plans(plan(0), _measured(0.5, calls), plan, None, tries=4)
    assert limit is None and calls == [150]


def test_a_plan_recomputing_little_is_not_worth_another_compile() -> None:
    calls: list[int] = []
    plan = _planner(190)  # 190 recomputes 1.0 of a 1000-FLOP forward: 10%
    search_plans(plan(0), _measured(0.5, calls), plan, 190, tries=4)
    assert calls[:2] == [190, 200]
    little = dataclasses.replace(plan(0), recompute_flops=20)  # 2%
    calls.clear()
    search_plans(little, _measured(0.5, calls), plan, 190, tries=4)
    assert calls == [190]


@pytest.mark.parametrize("ratio", [0.8, 1.0, 1.2])
def test_at_least_first_raises_the_limit_to_the_first_measured_peak_only_where_higher(
    ratio: float,
) -> None:
    """A budget that is the first plan's own simulated peak (150): a first plan measured above it
    lifts the limit to its measured peak and is kept; one measured below leaves the budget, within
    which cheaper plans are searched as for any budget."""
    done, limit, calls = _search(ratio, 150, tries=4, at_least_first=True)
    plain_done, plain_limit, plain_calls = _search(ratio, 150, tries=4)
    assert limit == max(150, int(150 * ratio))
    chosen = _chosen(done, limit)
    assert chosen is not None
    if ratio > 1:
        # half the first's excess given back (165: the plan at 160), which measures over: kept
        assert calls == [150, 160] and chosen.predicted_peak_bytes == int(150 * ratio)
        assert _chosen(plain_done, plain_limit).predicted_peak_bytes <= 150  # plain: other plans
    else:
        assert calls == plain_calls and chosen == _chosen(plain_done, plain_limit)


def _least_measured_high(frontier: list[tuple[int, float]], others: float):
    """A search for ``"memory"`` on ``frontier`` (simulated peak, cost; the least first): the
    least plan measures 1.4x its simulation, every other ``others`` x; the compiles in order."""
    calls: list[int] = []
    least = frontier[0][0]

    def plan(headroom: int) -> GraphPlan:
        fits = [(p, c) for p, c in frontier if p <= least - headroom]
        if not fits:
            raise BudgetError("nothing fits", budget_bytes=least, least_bytes=least)
        return _plan(*min(fits, key=lambda pc: pc[1]))

    def measured(plan: GraphPlan) -> Tried[None]:
        calls.append(plan.predicted_peak_bytes)
        sim = plan.predicted_peak_bytes
        peak = int(sim * (1.4 if sim == least else others))
        return Tried(dataclasses.replace(plan, predicted_peak_bytes=peak), None)

    done, limit = search_plans(plan(0), measured, plan, None, tries=4, at_least_peak=True)
    return done, limit, calls


def test_a_first_plan_measured_far_above_its_simulation_is_not_the_last_word() -> None:
    """At the least simulated peak (100) the first plan measures 1.4x (140, the limit); the next
    plans measure 1.05x: half the excess back (budget 120) finds one that is cheaper and peaks
    lower (126), which ``"memory"`` keeps. Before, the search stopped at the first plan: a budget
    plan then peaked below ``"memory"``'s (the frontier's CPU transformer, 16.9 vs 19.9 MiB)."""
    done, limit, calls = _least_measured_high(FRONTIER, 1.05)
    assert limit == 140
    assert calls == [100, 120]
    chosen = _chosen(done, limit)
    assert chosen is not None and chosen.predicted_peak_bytes == 126


def test_where_half_the_excess_plans_the_first_plan_again_all_of_it_is_given_back() -> None:
    """The next plan up from the least (100, measured 1.4x: 140) is simulated at 125: half the
    excess back (budget 120) plans the least plan again. All of it (budget 140) reaches the
    125 plan, measured 1.05x (131), lower than the first. Before, the search stopped at the
    first plan (with ``torch.compile``'s whole CSE, the transformer's ``"memory"`` stayed at its
    least plan's 19.1 MiB compiled, its next plan up never tried)."""
    done, limit, calls = _least_measured_high([(100, 10.0), (125, 5.0), (160, 1.0)], 1.05)
    assert limit == 140
    assert calls == [100, 125]
    chosen = _chosen(done, limit)
    assert chosen is not None and chosen.predicted_peak_bytes == 131


def test_where_all_the_excess_back_compiles_higher_the_first_plan_is_kept() -> None:
    """As above, but the 125 plan measures 1.2x (150, over the first's 140): it is not kept,
    and bisecting back to half the excess would plan the first plan again, so the search ends
    after two compiles."""
    done, limit, calls = _least_measured_high([(100, 10.0), (125, 5.0), (160, 1.0)], 1.2)
    assert calls == [100, 125]
    chosen = _chosen(done, limit)
    assert chosen is not None and chosen.predicted_peak_bytes == 140
