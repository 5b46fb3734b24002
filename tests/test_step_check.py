"""execution.step_check: a step checked against its budget as a whole, case by case."""

from __future__ import annotations

from memfit.execution.chain_state import ChainState
from memfit.execution.step_check import StepShares
from memfit.planning.budget import Budget
from memfit.planning.plan import GraphPlan, Plan

MiB = 2**20


def _graph(peak: int, budget: int | None) -> GraphPlan:
    return GraphPlan(
        policy="budget",
        decisions={},
        kept=(),
        recomputed=(),
        kept_bytes=0,
        predicted_peak_bytes=peak,
        baseline_peak_bytes=4 * MiB,
        baseline_kept_bytes=MiB,
        recompute_flops=0,
        forward_flops=1000,
        num_nodes=3,
        budget_bytes=budget,
    )


def test_one_graph_over_its_budget_is_refused_with_its_least_peak() -> None:
    step = StepShares()
    verdict = step.check(
        "f", Plan("budget", graphs=(_graph(3 * MiB, 2 * MiB),)), Budget(bytes=2 * MiB), ChainState()
    )
    assert verdict.error is not None and verdict.error.least_bytes == 3 * MiB
    assert not verdict.replan and verdict.over is None


def test_one_graph_within_its_budget_asks_nothing() -> None:
    plan = Plan("budget", graphs=(_graph(MiB, 2 * MiB),))
    verdict = StepShares().check("f", plan, Budget(bytes=2 * MiB), ChainState())
    assert verdict.error is None and not verdict.replan and verdict.over is None
