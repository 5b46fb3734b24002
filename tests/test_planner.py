"""The planner: a policy into a GraphPlan, and the frontier shared by the plans of one graph."""

from __future__ import annotations

import pytest
import torch

from memfit.analysis.transfers import Link
from memfit.bench.graphs import joint_graphs
from memfit.bench.zoo import cifar_resnet
from memfit.planning import planner
from memfit.planning.budget import Budget, BudgetError
from memfit.planning.planner import FrontierCache, plan_graph
from memfit.planning.policy import BUDGET, NAMED, Policy


@pytest.fixture(scope="module")
def graphs():
    torch.compiler.reset()
    first = joint_graphs(cifar_resnet(2, width=8), torch.randn(8, 3, 32, 32))[0]
    second = joint_graphs(cifar_resnet(1, width=8), torch.randn(8, 3, 32, 32))[0]
    return first, second


def _asked(jg) -> list[tuple[Policy, int]]:
    """What the measured search asks of one graph: "memory", then budgets at headrooms."""
    least = plan_graph(jg, Policy("memory")).predicted_peak_bytes
    at = Policy(BUDGET, budget=Budget(bytes=least))
    return [(Policy("memory"), 0), (at, -(1 << 20)), (at, -(1 << 19)), (Policy("memory"), 0)]


@pytest.mark.slow
def test_a_cache_computes_the_frontier_once_for_every_plan_of_its_graph(
    graphs, monkeypatch
) -> None:
    jg, _ = graphs
    asked = _asked(jg)
    uncached = [plan_graph(jg, p, headroom_bytes=h) for p, h in asked]
    calls = []
    real = planner.pareto_frontier

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(planner, "pareto_frontier", counted)
    cache = FrontierCache(jg)
    cached = [plan_graph(jg, p, headroom_bytes=h, cache=cache) for p, h in asked]
    assert len(calls) == 1
    assert [p.decisions for p in cached] == [p.decisions for p in uncached]
    assert [p.predicted_peak_bytes for p in cached] == [p.predicted_peak_bytes for p in uncached]
    plan_graph(jg, Policy("memory"))  # without one, every plan computes its own
    assert len(calls) == 2


def test_offload_plans_are_cached_apart_from_recompute_only_ones(graphs) -> None:
    jg, _ = graphs
    cache = FrontierCache(jg)
    plain = plan_graph(jg, Policy("memory"), cache=cache)
    link = Link(1e18, 1e18)
    offloading = plan_graph(jg, Policy("memory", offload=True), link=link, cache=cache)
    assert set(cache.points) == {False, True}
    assert not plain.transfers and offloading.transfers
    assert plan_graph(jg, Policy("memory"), cache=cache).decisions == plain.decisions


def test_a_cache_refuses_another_graph(graphs) -> None:
    first, second = graphs
    cache = FrontierCache(first)
    with pytest.raises(ValueError, match="another graph"):
        plan_graph(second, Policy("memory"), cache=cache)


def test_under_inductor_a_roomy_budget_keeps_less_than_plain_autograd() -> None:
    """Under Inductor keeping a value the forward would otherwise fuse away costs its write
    (``analysis.cost.keeping_seconds``): on a pre-activation ResNet a budget with room for
    everything takes the plan recomputing BatchNorm and ReLU inside the backward's kernels, as
    torch.compile's partitioner does, and no convolution. Under eager kernels keeping is free,
    and the same budget keeps everything."""
    model, batch = cifar_resnet(2, width=8), torch.randn(8, 3, 32, 32)
    (eager,) = joint_graphs(model, batch)
    (fused,) = joint_graphs(model, batch, executor="inductor")
    roomy = Policy(BUDGET, budget=Budget(fraction=1.0))
    assert plan_graph(eager, roomy).kept_bytes == plan_graph(eager, Policy("none")).kept_bytes
    chosen, none = plan_graph(fused, roomy), plan_graph(fused, Policy("none"))
    assert chosen.kept_bytes < 0.7 * none.kept_bytes
    assert chosen.cost_seconds < none.cost_seconds
    assert not any(n.startswith("convolution") for n in chosen.recomputed)


def test_every_policy_plans_from_its_entry_in_the_one_table() -> None:
    torch.compiler.reset()
    layers = [m for _ in range(6) for m in (torch.nn.Linear(64, 64), torch.nn.GELU())]
    (jg,) = joint_graphs(torch.nn.Sequential(*layers), torch.randn(64, 64))
    assert set(planner._PLANNERS) == set(NAMED) | {BUDGET}
    link = Link(out_bytes_per_s=1e9, in_bytes_per_s=1e9)
    plans = {name: plan_graph(jg, Policy(name), link=link, offload_to="cpu") for name in NAMED}
    least = plans["memory"].predicted_peak_bytes
    plans[BUDGET] = plan_graph(jg, Policy(BUDGET, budget=Budget(bytes=least)))
    none = plans["none"]
    assert none.predicted_peak_bytes == none.baseline_peak_bytes
    assert none.recomputed == ()
    for name, plan in plans.items():
        assert plan.policy == name
        assert plan.predicted_peak_bytes <= plan.baseline_peak_bytes, name
    assert plans[BUDGET].predicted_peak_bytes <= least < none.predicted_peak_bytes


@pytest.mark.parametrize("offload", [False, True])
def test_a_budget_no_plan_meets_says_what_would(graphs, offload: bool) -> None:
    """Below the least peak, the error says how to go lower: offloading where the policy does not
    yet offload, else a smaller batch; and it keeps the least peak memfit can reach."""
    jg, _ = graphs
    policy = Policy(BUDGET, budget=Budget(bytes=1024), offload=offload)
    link = Link(1e18, 1e18) if offload else None
    with pytest.raises(BudgetError) as raised:
        plan_graph(jg, policy, link=link)
    message = str(raised.value)
    assert ("offload=True" in message) is not offload
    assert "smaller batch" in message
    assert raised.value.least_bytes is not None and raised.value.least_bytes > 1024
