"""execution.chain_state: the chain's rule and plans carried from call to call."""

from __future__ import annotations

from memfit.execution.chain_state import ChainState
from memfit.planning.budget import Budget
from memfit.planning.plan import GraphPlan, Plan
from memfit.planning.plan_chain import KEEP_ALL, ChainRun, ChainValue
from memfit.planning.policy import Policy

MiB = 2**20


def _chain(n: int) -> tuple[list[ChainRun], list[ChainValue], Plan]:
    runs = [ChainRun("layer", MiB, 3 * MiB, 0, 0, 1000, MiB) for _ in range(n)]
    values = [ChainValue(i, MiB, readers=(i + 1,), savers=(i + 1,)) for i in range(n - 1)]
    graph = GraphPlan(
        policy="memory",
        decisions={},
        kept=(),
        recomputed=(),
        kept_bytes=0,
        predicted_peak_bytes=3 * MiB,
        baseline_peak_bytes=4 * MiB,
        baseline_kept_bytes=MiB,
        recompute_flops=0,
        forward_flops=1000,
        num_nodes=3,
    )
    return runs, values, Plan("memory", graphs=(graph,) * n)


def test_memory_tries_each_graph_keeping_the_least_once_and_decides_on_a_settled_call() -> None:
    runs, values, plan = _chain(16)
    state, memory = ChainState(), Policy("memory")
    first = state.after_call(runs, values, plan, settled=False, policy=memory)
    assert state.rule != KEEP_ALL and first.shown is not None and first.shown.segments
    assert first.replan and state.least_kept  # tried: the graphs are captured again
    assert state.mode(active=True) == (True, None) and state.mode(active=False) is None
    # the call that captured them again decides nothing: its graphs have seen no backward
    assert not state.after_call(runs, values, plan, False, memory).replan and not state.decided
    # no lower than before: back to each graph's own plans, for good
    assert state.after_call(runs, values, plan, settled=True, policy=memory).replan
    assert state.decided and not state.least_kept and state.mode(active=True) is None
    assert not state.after_call(runs, values, plan, settled=True, policy=memory).replan


def test_a_budget_the_chain_holds_is_refused_once_settled_with_the_least_it_reached() -> None:
    runs, values, plan = _chain(16)
    state, budget = ChainState(), Policy("budget", budget=Budget(bytes=MiB))
    state.hold(Budget(bytes=MiB), plan)  # below what any rule reaches on these runs
    assert state.mode(active=True) == (False, MiB)
    assert state.after_call(runs, values, plan, False, budget).refuse is None  # not settled
    assert state.after_call(runs, values, plan, True, budget).replan  # try keeping the least
    state.after_call(runs, values, plan, True, budget)  # decided
    refused = state.after_call(runs, values, plan, True, budget).refuse
    assert refused is not None and state.next is not None and refused == state.next[1]


def test_a_fraction_the_chain_holds_is_plain_autograds_peak_less_its_share() -> None:
    runs, values, plan = _chain(4)
    state = ChainState()
    state.hold(Budget(fraction=0.5), plan)
    assert state.budget == plan.baseline_peak_bytes - plan.baseline_kept_bytes // 2


def test_one_run_is_no_chain() -> None:
    runs, values, plan = _chain(1)
    state = ChainState()
    assert state.after_call(runs, values, plan, True, Policy("memory")).shown is None
    assert state.rule == KEEP_ALL and state.next is None
