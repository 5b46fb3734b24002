"""After a call that planned graphs under a budget: does the step fit it as a whole?

One graph: its plan was made against the step's budget, and a fraction it could not meet is an
error now (``planning.planner``'s ``first_plan``). Several graphs (graph breaks): each was planned
as the step's first call reached it, against what the graphs before it keep; unless they were
planned together and fit, memfit chooses one plan per graph from their frontiers for the whole
step (``planning.step_budget``) and plans each graph again with its share on the next call, at
most ``STEP_ROUNDS`` times, then says once that the step stays over; where no combination fits,
the chain holds the budget from the next call (``execution.chain_state``) if the graphs run as
one, else BudgetError now.

``StepShares`` is what a call session (``execution.session``) keeps of this from call to call;
``StepVerdict`` is what one check asks of it, as ``ChainOutcome`` is for the chain.
"""

from __future__ import annotations

import dataclasses

from memfit.execution.chain_state import ChainState
from memfit.planning.budget import Budget, BudgetError
from memfit.planning.plan import Plan
from memfit.planning.step_budget import (
    GraphShare,
    least_step_peak,
    planned_as_step,
    share_step,
    step_budget_bytes,
)
from memfit.units import format_bytes

__all__ = ["STEP_ROUNDS", "StepShares", "StepVerdict", "refused_step"]

#: Times a step with graph breaks is planned again as a whole before memfit says it cannot.
STEP_ROUNDS = 3


@dataclasses.dataclass(frozen=True)
class StepVerdict:
    """What a check asks of the session: plan again from the next call, refuse the budget now
    (``error``), or say once that the step stays over its budget of ``over`` bytes."""

    replan: bool = False
    error: BudgetError | None = None
    over: int | None = None


def refused_step(name: str, plan: Plan, budget: int, smallest: int) -> BudgetError:
    """The error for a step of several graphs that no plan brings within ``budget``."""
    return BudgetError(
        f"no plan fits a budget of {format_bytes(budget)}: {name} runs in "
        f"{len(plan.graphs)} graphs (graph breaks), and the smallest peak memfit can "
        f"reach for the whole step is {format_bytes(smallest)} ({smallest} bytes)",
        budget_bytes=budget,
        least_bytes=smallest,
    )


def _refused_graph(budget: int, least: int) -> BudgetError:
    return BudgetError(
        f"no plan fits a budget of {format_bytes(budget)}: the smallest "
        f"peak memfit can reach for this graph is {format_bytes(least)} ({least} bytes)",
        budget_bytes=budget,
        least_bytes=least,
    )


@dataclasses.dataclass
class StepShares:
    """A step of several graphs planned as a whole for its budget (see the module)."""

    #: per graph and sizes (``GraphPlan.sized_key``): its share of the step's budget
    shares: dict[str, GraphShare] = dataclasses.field(default_factory=dict)
    #: per step (its graphs' sized keys): the rounds it was planned as a whole
    rounds: dict[tuple[str, ...], int] = dataclasses.field(default_factory=dict)

    def check(self, name: str, plan: Plan, budget: Budget, chain: ChainState) -> StepVerdict:
        """The step of ``name`` that ran ``plan``, just planned, against ``budget``; ``chain``
        is the call's chain (it may hold the budget from the next call)."""
        if len(plan.graphs) == 1:
            graph = plan.graphs[0]
            if graph.budget_bytes is not None and graph.predicted_peak_bytes > graph.budget_bytes:
                return StepVerdict(
                    error=_refused_graph(graph.budget_bytes, graph.predicted_peak_bytes)
                )
            return StepVerdict()
        step_bytes = step_budget_bytes(budget, plan)
        if chain.budget is not None and chain.next is not None:
            return StepVerdict()  # the chain holds the budget (execution.chain_state)
        if planned_as_step(plan, step_bytes):
            return StepVerdict()
        shares = share_step(plan, step_bytes)
        if shares is None and chain.next is not None:
            # No plans of the graphs fit it together: from the next call the chain holds it.
            chain.hold(budget, plan)
            return StepVerdict(replan=True)
        if shares is None:
            return StepVerdict(error=refused_step(name, plan, step_bytes, least_step_peak(plan)))
        step = tuple(g.sized_key for g in plan.graphs)
        rounds = self.rounds.get(step, 0)
        if rounds >= STEP_ROUNDS:
            over = plan.predicted_peak_bytes > step_bytes
            return StepVerdict(over=step_bytes if over else None)
        if not shares:  # every graph is inside a region: nothing to plan again
            return StepVerdict()
        self.rounds[step] = rounds + 1
        self.shares.update(shares)
        return StepVerdict(replan=True)
