"""The Pareto frontier: ordered, anchored at plain autograd, and answering budgets monotonically."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from memfit.analysis.cost import keeping_seconds
from memfit.analysis.simulate import simulate_step
from memfit.bench.graphs import joint_graphs
from memfit.bench.zoo import cifar_resnet, tanh_chain, unet
from memfit.planning import frontier
from memfit.planning.budget import BudgetError
from memfit.planning.frontier import activations, choose, least_peak_point, pareto_frontier
from memfit.planning.keep_rules import keep_all, keep_min_peak


@pytest.fixture(scope="module", params=["tanh", "resnet", "unet"])
def graph(request):
    torch.compiler.reset()
    if request.param == "tanh":
        return joint_graphs(tanh_chain(40, width=64), torch.randn(64, 64, requires_grad=True))[0]
    if request.param == "resnet":
        return joint_graphs(cifar_resnet(3), torch.randn(4, 3, 32, 32))[0]
    return joint_graphs(unet(depth=2, width=4), torch.randn(2, 1, 32, 32))[0]


def test_frontier_is_pareto_ordered(graph) -> None:
    points = pareto_frontier(graph)
    peaks = [p.peak_bytes for p in points]
    costs = [p.recompute_seconds for p in points]
    assert peaks == sorted(peaks) and len(set(peaks)) == len(peaks)
    assert all(a > b for a, b in zip(costs, costs[1:])), "more memory must buy less recompute"
    for p in points:  # every point's peak is the simulator's, for the very set it keeps
        assert simulate_step(graph, p.kept).peak_bytes == p.peak_bytes


def test_frontier_spans_plain_autograd_to_memory_mode(graph) -> None:
    points = pareto_frontier(graph)
    assert points[-1].peak_bytes == simulate_step(graph, keep_all(graph)).peak_bytes
    assert points[-1].recompute_seconds == 0
    assert points[0].peak_bytes <= simulate_step(graph, keep_min_peak(graph)).peak_bytes


def test_choose_is_cheapest_within_budget_and_monotonic(graph) -> None:
    points = pareto_frontier(graph)
    lo, hi = points[0].peak_bytes, points[-1].peak_bytes
    previous = None
    for budget in torch.linspace(hi, lo, 25).tolist():
        chosen = choose(points, int(budget))
        assert chosen.peak_bytes <= int(budget)
        fits = [p for p in points if p.peak_bytes <= int(budget)]
        assert chosen.recompute_seconds == min(p.recompute_seconds for p in fits)
        if previous is not None:
            assert chosen.peak_bytes <= previous.peak_bytes
        previous = chosen


def test_too_small_budget_names_the_smallest(graph) -> None:
    points = pareto_frontier(graph)
    with pytest.raises(BudgetError) as info:
        choose(points, points[0].peak_bytes - 1)
    assert info.value.least_bytes == points[0].peak_bytes
    assert str(points[0].peak_bytes) in str(info.value)


def test_time_limit_keeps_the_anchors_and_warns(graph) -> None:
    """With no time to solve, the fallback still has plain autograd and "memory", and the user
    is told the plan depended on the machine's speed."""
    with pytest.warns(UserWarning, match="depends on this machine's speed"):
        points = pareto_frontier(graph, time_limit_s=0.0)
    assert points[-1].peak_bytes == simulate_step(graph, keep_all(graph)).peak_bytes
    assert points[0].peak_bytes <= simulate_step(graph, keep_min_peak(graph)).peak_bytes


def test_budget_at_memory_modes_peak_is_memory_mode_or_cheaper(graph) -> None:
    """ "memory" is one point of the frontier's family; the budget plan at its peak never costs
    more, and differs from it only by recomputing less (see ``planning.frontier``)."""
    points = pareto_frontier(graph)
    memory = simulate_step(graph, keep_min_peak(graph))
    chosen = choose(points, memory.peak_bytes)
    forward = set(graph.forward)
    from memfit.analysis.cost import node_seconds

    memory_cost = sum(node_seconds(n) for n in memory.backward if n in forward)
    assert chosen.peak_bytes <= memory.peak_bytes
    assert chosen.recompute_seconds <= memory_cost + 1e-12


class _SlowClock:
    """``time.perf_counter`` of a machine on which every step of the search takes ``step``
    seconds: deterministic, however busy the machine running the test is."""

    def __init__(self, step: float) -> None:
        self.now, self.step, self.readings = 0.0, step, 0

    def __call__(self) -> float:
        self.now += self.step
        self.readings += 1
        return self.now


def test_inductor_plans_do_not_depend_on_the_machines_speed(monkeypatch) -> None:
    """The Inductor candidates are counted work: on a machine where they take 30-60 s (the old
    20 s cut-off dropped them all) the frontier is the one an idle machine finds, and nothing
    warns."""
    torch.manual_seed(0)
    (jg,) = joint_graphs(unet(depth=2, width=4), torch.randn(2, 1, 32, 32), executor="inductor")
    fast = pareto_frontier(jg)
    counter = _SlowClock(0.0)  # counts the clock's readings in one search
    monkeypatch.setattr(frontier.time, "perf_counter", counter)
    pareto_frontier(jg, time_limit_s=1e9)
    clock = _SlowClock(60.0 / counter.readings)  # a search that takes 60 s
    monkeypatch.setattr(frontier.time, "perf_counter", clock)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        slow = pareto_frontier(jg, time_limit_s=1e9)
    assert 20.0 < clock.now < frontier.FUSED_SAFETY_LIMIT_S, clock.now
    assert [p.kept for p in slow] == [p.kept for p in fast]
    assert any(p.source.startswith(("fused", "torch.compile")) for p in slow)


def test_inductor_candidates_stop_at_the_safety_limit_and_warn(monkeypatch) -> None:
    torch.manual_seed(0)
    (jg,) = joint_graphs(unet(depth=2, width=4), torch.randn(2, 1, 32, 32), executor="inductor")
    monkeypatch.setattr(frontier.time, "perf_counter", _SlowClock(10.0))
    with pytest.warns(UserWarning, match="safety limit for Inductor candidates"):
        points = pareto_frontier(jg, time_limit_s=1e9)
    # plain autograd was among the points: every budget it fits is answered at no more cost
    baseline = keeping_seconds(jg, activations(jg, keep_all(jg)))
    assert points[-1].peak_bytes <= simulate_step(jg, keep_all(jg)).peak_bytes
    assert points[-1].cost_seconds <= baseline + 1e-12


def test_memory_point_under_inductor_is_the_cheapest_near_the_least_peak(graph) -> None:
    """Eager "memory" is the least simulated peak; where peaks are estimates (Inductor) it is the
    cheapest point within MIN_GAP of it, never one beyond."""
    points = pareto_frontier(graph)
    base = simulate_step(graph, keep_all(graph)).peak_bytes
    gap = int(frontier.MIN_GAP * base)
    lowest = points[0]
    assert least_peak_point(points, base, estimate=False) is lowest
    assert least_peak_point([lowest], base, estimate=True) is lowest
    least = dataclasses.replace(lowest, recompute_seconds=1.0)
    near = dataclasses.replace(least, peak_bytes=least.peak_bytes + gap // 2, recompute_seconds=0.5)
    beyond = dataclasses.replace(least, peak_bytes=least.peak_bytes + gap + 1, recompute_seconds=0)
    candidates = [least, near, beyond]
    assert least_peak_point(candidates, base, estimate=True) is near
    assert least_peak_point(candidates, base, estimate=False) is least
    # a budget at the chosen point's peak returns it: "memory" and budgets stay one family
    chosen = least_peak_point(points, base, estimate=True)
    assert choose(points, chosen.peak_bytes) is chosen
    assert chosen.peak_bytes <= lowest.peak_bytes + gap
