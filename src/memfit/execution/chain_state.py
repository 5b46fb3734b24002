"""What one memfit wrapper carries from call to call about the chain of its graph runs
(``execution.run_chain``): the segment rule the next call runs by, how the chain's graphs are
planned, and whether a budget is held by the chain.

Each call's chain is planned from the call just made (``planning.plan_chain``): the rule is chosen
on its runs, and the plan shows those runs under it. Two choices take more than one call, since each
changes how the graphs are planned and so needs a capture:

* ``"memory"`` tries, once, each graph keeping the least it can
  (``planning.frontier.least_kept_point``), and keeps that only where the chain then reaches a
  lower peak. The comparison waits for a call that captured nothing: its graphs' plans have seen
  their backwards (which outputs the caller let go), as the plans compared against had.
* A budget that no plans of the graphs fit together (``planning.step_budget``) is held by the
  chain from the next call: its graphs planned as ``"memory"`` plans them, the chain dropping the
  fewest runs that fit, each graph keeping the least tried where that is what fits; refused,
  once settled, with the least peak the chain reached, ``"memory"``'s.

Why try keeping the least: on a chain of 100 tanh layers broken by an ``.item()``, each graph's
own least-peak plan kept the layer's output for its backward, and the replayed segments held it
beside their inputs (31.5 MB against 23.1 with the least kept). Why not always: on three graphs
broken around a Linear, the least kept recomputed a Linear's input inside each graph and the
step peaked 11% higher (4.75 against 4.27 MB); there no segment helped.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.planning.budget import Budget
from memfit.planning.plan import Plan
from memfit.planning.plan_chain import (
    KEEP_ALL,
    ChainPlan,
    ChainRun,
    ChainSummary,
    ChainValue,
    choose,
    segments_of,
    simulate,
    summary,
)
from memfit.planning.policy import Policy
from memfit.planning.step_budget import step_budget_bytes

__all__ = ["ChainOutcome", "ChainState"]


@dataclass(frozen=True)
class ChainOutcome:
    """What a call's chain asks of its wrapper: the plan's chain to show, whether to capture
    and plan the graphs again, and, where the chain holds a budget nothing reaches, the least
    peak to refuse it with."""

    shown: ChainSummary | None = None
    replan: bool = False
    refuse: int | None = None


class ChainState:
    """The chain of one wrapper's calls (see the module)."""

    def __init__(self) -> None:
        #: how the next call cuts its runs into segments
        self.rule: ChainPlan = KEEP_ALL
        #: whether each graph keeps the least it can, the chain's least peak before that was
        #: tried (None: not tried), and whether the try is decided
        self.least_kept = False
        self.tried: int | None = None
        self.decided = False
        #: the step's budget in bytes where the chain holds it (None: the graphs' plans do)
        self.budget: int | None = None
        #: the last call's chain: the simulated peak under ``rule`` and the least any rule
        #: reaches (None: the last call ran no chain)
        self.next: tuple[int, int] | None = None
        #: the last runs chosen for and what was chosen: a step that runs the same graphs on
        #: the same sizes as the last one is not simulated again (15-25 ms on 200 runs)
        self._chosen: tuple[object, tuple[ChainPlan, int, int, ChainSummary]] | None = None

    def mode(self, active: bool) -> tuple[bool, int | None] | None:
        """How the partitioner plans a graph of the chain (``BackendEvents.chain_mode``): None
        where its policy plans it alone (or no chain runs: ``active`` False)."""
        if not active or (self.budget is None and not self.least_kept):
            return None
        return (self.least_kept, self.budget)

    def hold(self, budget: Budget, plan: Plan) -> None:
        """From the next call the chain holds ``budget``: no plans of the graphs fit together.

        A fraction is then plain autograd's peak less its share of the activations: the least
        peak of plans keeping that share (``step_budget_bytes``) bounds plans of the graphs
        alone, which the chain's segments go below."""
        self.budget = budget.resolve(plan.baseline_peak_bytes, plan.baseline_kept_bytes)

    def after_call(
        self,
        runs: list[ChainRun],
        values: list[ChainValue],
        plan: Plan,
        settled: bool,
        policy: Policy,
    ) -> ChainOutcome:
        """The rule for the next call from the runs of the call just made (``settled``: it
        captured nothing) under the call's ``policy``, and what the call does about it."""
        self.next = None
        if len(runs) < 2 or len(runs) != len(plan.graphs):
            self.rule = KEEP_ALL
            return ChainOutcome()
        budget = self.budget
        if budget is None and policy.budget is not None:
            budget = step_budget_bytes(policy.budget, plan)
        key = (tuple(runs), tuple(values), budget)
        if self._chosen is None or self._chosen[0] != key:
            self._chosen = (key, self._choose(runs, values, budget))
        self.rule, peak, least, shown = self._chosen[1]
        self.next = (peak, least)
        replan = False
        refuse = None
        if policy.least_memory and (self.rule != KEEP_ALL or self.tried is not None):
            replan = self._keep_least(least, settled)
        elif self.budget is not None and peak > self.budget and settled:
            if self.tried is None or not self.decided:
                replan = self._keep_least(least, settled)
            else:  # each graph keeping the least was tried: nothing reaches the budget
                refuse = min(least, self.tried)
        return ChainOutcome(shown, replan, refuse)

    @staticmethod
    def _choose(
        runs: list[ChainRun], values: list[ChainValue], budget: int | None
    ) -> tuple[ChainPlan, int, int, ChainSummary]:
        """The rule for these runs, its simulated peak, the least any rule reaches, and what
        the plan shows: these runs under the rule the next call runs by (the same as this
        call's once the rule settles; what ``memfit.plan`` shows before any)."""
        rule = choose(runs, values, budget)
        segments = segments_of(runs, rule)
        shown = summary(runs, values, segments)
        peak = least = shown.peak_bytes
        if budget is not None and peak > budget:
            least, _ = simulate(runs, values, segments_of(runs, choose(runs, values)))
        return rule, peak, least, shown

    def _keep_least(self, least: int, settled: bool) -> bool:
        """Try each graph keeping the least, or decide the try (see the module); whether the
        graphs must be planned again."""
        if self.tried is None:
            self.tried = least  # the chain's least with each graph's own plans
            self.least_kept = True
            return True
        if not self.least_kept or self.decided or not settled:
            return False  # decided, or the graphs just captured have not run a backward yet
        self.decided = True
        if least >= self.tried:
            self.least_kept = False
            return True
        return False
