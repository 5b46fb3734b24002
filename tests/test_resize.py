"""A plan at other sizes (``planning.resize``): the same decisions simulated at each size, and
the range of sizes they are used for."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from memfit.analysis.sizes import Sizes
from memfit.bench.graphs import joint_graphs
from memfit.bench.zoo import tanh_chain
from memfit.planning.budget import Budget
from memfit.planning.plan import GraphPlan
from memfit.planning.planner import plan_graph, with_executor_peaks
from memfit.planning.policy import BUDGET, Policy
from memfit.planning.resize import (
    MEMORY_SLACK,
    RANGE_FACTORS,
    CompiledOffset,
    holds,
    plan_at,
    size_range,
)


def _chain():
    """A 12-tanh chain on a [16, 64] input captured with both sizes as symbols: every tensor is
    16 * 64 floats, so every byte count scales with the product of the two."""
    (jg,) = joint_graphs(tanh_chain(12, 64), torch.randn(16, 64, requires_grad=True), dynamic=True)
    values = {}
    for n in jg.nodes:
        if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor):
            for size, hint in zip(n.meta["val"].shape, (16, 64), strict=True):
                values[size.node.expr] = hint
    assert len(values) == 2 and set(values) == set(jg.symbols)
    return jg, Sizes(values)


def test_the_same_decisions_at_other_sizes_scale_with_the_tensors() -> None:
    jg, hints = _chain()
    policy = Policy("memory")
    plan = plan_graph(jg, policy)
    same = plan_at(jg, plan, policy, hints)
    assert same.predicted_peak_bytes == plan.predicted_peak_bytes
    assert same.kept_bytes == plan.kept_bytes and same.sizes == hints.key
    doubled = plan_at(jg, plan, policy, hints.scaled(2))  # [32, 128]: 4x every tensor
    assert doubled.decisions is plan.decisions and doubled.kept == plan.kept
    assert dict(doubled.sizes) == {str(s): 2 * v for s, v in hints.items()}
    assert doubled.predicted_peak_bytes == 4 * plan.predicted_peak_bytes
    assert doubled.baseline_peak_bytes == 4 * plan.baseline_peak_bytes
    assert doubled.kept_bytes == 4 * plan.kept_bytes
    assert doubled.recompute_flops == 4 * plan.recompute_flops
    assert plan.predicted_peak_bytes < plan.baseline_peak_bytes  # it does recompute


def test_a_byte_budget_is_used_up_to_the_largest_size_tried_within_it() -> None:
    """Keeping everything is the cheapest plan within 20x plain autograd's peak; it stays within
    the budget at 4x the sizes (16x the bytes), not at 8x (64x); bisected three times, the
    range ends at 4 * 2 ** (1/8) = 4.36x (19x the bytes; 4.76x would be 22.6x). Below, it ends at
    half the sizes, where a plan recomputing less would fit."""
    jg, hints = _chain()
    baseline = plan_graph(jg, Policy("none")).predicted_peak_bytes
    policy = Policy(BUDGET, budget=Budget(bytes=20 * baseline))
    plan = plan_graph(jg, policy)
    assert plan.predicted_peak_bytes == baseline
    bounds = size_range(jg, plan, policy, hints)
    assert {str(s): b for s, b in bounds.items()} == {
        str(s): (v // 2, math.floor(v * 4 * 2 ** (1 / 8)))
        for s, v in hints.items()  # below half: a cheaper plan fits
    }


def test_memory_keeps_its_decisions_while_it_saves_as_much() -> None:
    """The chain's peak share of plain autograd's is the same at every size: the range is
    unbounded below and reaches the largest factor tried above."""
    jg, hints = _chain()
    policy = Policy("memory")
    bounds = size_range(jg, plan_graph(jg, policy), policy, hints)
    top = RANGE_FACTORS[-1]
    assert {str(s): b for s, b in bounds.items()} == {
        str(s): (None, top * v) for s, v in hints.items()
    }


def _report(peak: int, baseline: int, *, kept: int = 0, baseline_kept: int = 0) -> GraphPlan:
    return GraphPlan(
        policy="x",
        decisions={},
        kept=(),
        recomputed=(),
        kept_bytes=kept,
        predicted_peak_bytes=peak,
        baseline_peak_bytes=baseline,
        baseline_kept_bytes=baseline_kept,
        recompute_flops=0,
        forward_flops=0,
        num_nodes=0,
    )


def test_holds_says_what_each_policy_promises() -> None:
    planned = _report(50, 100)
    memory = Policy("memory")
    assert holds(planned, _report(100, 200), memory)
    assert holds(planned, _report(int(200 * (0.5 + MEMORY_SLACK)), 200), memory)
    assert not holds(planned, _report(int(200 * (0.5 + MEMORY_SLACK)) + 2, 200), memory)
    assert not holds(planned, _report(101, 100), Policy("speed"))  # worse than plain autograd
    assert holds(planned, _report(101, 100), Policy("none"))
    budget = Policy(BUDGET, budget=Budget(bytes=1000))
    fits = dataclasses.replace(_report(900, 2000), budget_bytes=1000)
    assert holds(planned, fits, budget)
    assert not holds(planned, fits, budget, spent_bytes=200)  # earlier graphs keep 200
    over = dataclasses.replace(_report(1001, 2000), budget_bytes=1000)
    assert not holds(planned, over, budget)


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_a_fraction_resolves_at_each_size(fraction: float) -> None:
    jg, hints = _chain()
    policy = Policy(BUDGET, budget=Budget(fraction=fraction))
    plan = plan_graph(jg, policy)
    at = plan_at(jg, plan, policy, hints.scaled(2))
    assert at.budget_bytes is not None and at.budget_bytes >= at.predicted_peak_bytes
    assert holds(plan, at, policy)


def test_a_compiled_plans_offset_scales_with_the_activations() -> None:
    """A plan predicted from its compiled graphs (here: 30% below its simulation, as Inductor's
    fused kernels often hold less) is predicted at other sizes as the simulation there moved by
    that difference, grown as the simulated peak less gradients: every byte of the chain scales
    with the product of its two sizes, so at twice both sizes the prediction is 4x too."""
    jg, hints = _chain()
    policy = Policy("memory")
    simulated = plan_graph(jg, policy)
    compiled = with_executor_peaks(
        simulated,
        int(0.7 * simulated.forward_peak_bytes),
        int(0.7 * simulated.backward_peak_bytes),
        forward_end=int(0.7 * simulated.forward_end_bytes),
        source="a test",
    )
    offset = CompiledOffset.between(compiled, plan_at(jg, compiled, policy, hints))
    assert offset.backward_peak_bytes < 0
    same = plan_at(jg, compiled, policy, hints, offset=offset)
    assert same.predicted_peak_bytes == compiled.predicted_peak_bytes
    doubled = plan_at(jg, compiled, policy, hints.scaled(2), offset=offset)
    assert doubled.predicted_peak_bytes == pytest.approx(
        4 * compiled.predicted_peak_bytes, rel=1e-6
    )
    assert doubled.forward_end_bytes == pytest.approx(4 * compiled.forward_end_bytes, rel=1e-6)
    plain = plan_at(jg, compiled, policy, hints.scaled(2))
    assert doubled.predicted_peak_bytes < plain.predicted_peak_bytes  # the simulation's, unmoved
    assert "scaled with the simulated peak less gradients" in doubled.note
