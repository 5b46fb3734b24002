"""Planning offload: "swap" hides its copies; offload takes the frontier below the floor."""

from __future__ import annotations

import pytest
import torch

from memfit.analysis.cost import node_seconds
from memfit.analysis.simulate import simulate_step
from memfit.analysis.transfers import Link
from memfit.bench.graphs import joint_graphs
from memfit.bench.zoo import cifar_resnet
from memfit.planning.budget import parse_budget
from memfit.planning.decision import Decision
from memfit.planning.frontier import pareto_frontier
from memfit.planning.keep_rules import keep_all
from memfit.planning.offload import swap, with_offload
from memfit.planning.planner import plan_graph
from memfit.planning.policy import BUDGET, Policy, parse_policy

FAST = Link(1e18, 1e18)


@pytest.fixture(scope="module")
def jg():
    torch.compiler.reset()
    return joint_graphs(cifar_resnet(2, width=8), torch.randn(8, 3, 32, 32))[0]


def test_swap_offloads_what_hides_and_nothing_on_a_slow_link(jg) -> None:
    kept = keep_all(jg)
    sim = simulate_step(jg, kept)
    seconds = {n: node_seconds(n) for n in jg.nodes}
    fast = swap(jg, kept, sim, FAST, seconds, min_bytes=1)
    assert fast.schedule.transfers and fast.simulation.peak_bytes < sim.peak_bytes
    slow = swap(jg, kept, sim, Link(1.0, 1.0), seconds, min_bytes=1)
    assert slow.schedule.transfers == ()
    assert slow.simulation.peak_bytes == sim.peak_bytes
    # Whatever it picks on a middling link, its stall stays within the tolerance.
    middling = swap(jg, kept, sim, Link(2e9, 2e9), seconds, min_bytes=1, tolerance=0.01)
    assert middling.schedule.stall_seconds <= 0.01 * middling.schedule.compute_seconds + 1e-12


def test_offload_extends_the_frontier_below_the_recompute_floor(jg) -> None:
    points = pareto_frontier(jg)
    seconds = {n: node_seconds(n) for n in jg.nodes}
    extended = with_offload(jg, points, FAST, seconds, min_bytes=1)
    assert extended[0].peak_bytes < points[0].peak_bytes
    assert extended[0].schedule is not None
    costs = [p.cost_seconds for p in extended]
    assert costs == sorted(costs, reverse=True)  # by increasing peak, decreasing cost


def test_budget_below_the_floor_fits_only_with_offload(jg) -> None:
    floor = pareto_frontier(jg)[0].peak_bytes
    budget = Policy(BUDGET, budget=parse_budget(int(floor * 0.9)))
    from memfit.planning.budget import BudgetError

    with pytest.raises(BudgetError):
        plan_graph(jg, budget)
    offload = Policy(BUDGET, budget=parse_budget(int(floor * 0.9)), offload=True)
    plan = plan_graph(jg, offload, link=FAST, offload_to="disk", offload_min_bytes=1)
    assert plan.predicted_peak_bytes <= int(floor * 0.9)
    assert plan.offloaded and plan.offload_to == "disk"
    offloaded = [name for name, d in plan.decisions.items() if d is Decision.OFFLOAD]
    assert sorted(offloaded) == sorted(plan.offloaded)
    assert not set(plan.offloaded) & set(plan.kept)


def test_policies_that_offload() -> None:
    assert parse_policy("swap").offload
    assert Policy("memory", offload=True).label == "memory + offload"
    with pytest.raises(ValueError, match="offload=True goes with"):
        Policy("speed", offload=True)


def test_offloading_policy_needs_a_link(jg) -> None:
    with pytest.raises(ValueError, match="link"):
        plan_graph(jg, parse_policy("swap"))
