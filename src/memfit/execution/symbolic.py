"""One graph captured with symbolic sizes: its plan at every size it runs, and its size range.

A dimension that varied between calls is captured by Dynamo as a symbol, so one graph (and one
plan's decisions) serves many sizes (NOTE [One capture for many sizes] in ``planning.resize``).
This is the execution side of that: when the graph is planned, the range of sizes its decisions
hold for becomes guards of the capture (evaluating ``size <= hi`` on the symbol records it, as
any size test in a traced model does), so Dynamo captures a size outside the range again; and
at every call the forward reads the sizes it runs at from its own arguments, and reports the
plan at those sizes, simulated once per distinct size and cached.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from memfit._compat import size_expr, size_hint
from memfit.analysis.graph import JointGraph
from memfit.analysis.sizes import SizeKey, Sizes
from memfit.planning.plan import GraphPlan
from memfit.planning.policy import Policy
from memfit.planning.resize import CompiledOffset, holds, plan_at, size_range

__all__ = ["PlansBySize"]

#: Distinct sizes whose plans one graph keeps; another size is simulated again (milliseconds).
CACHED_SIZES = 256


def _symbols_of(gm: fx.GraphModule) -> dict[Any, tuple[int, int | None, Any]]:
    """Each size symbol of ``gm``'s inputs: ``(placeholder index, dim or None, value)``, where
    the symbol is an input itself (dim None) or the size ``dim`` of an input tensor."""
    found: dict[Any, tuple[int, int | None, Any]] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt):
            expr = size_expr(val)
            if getattr(expr, "is_Symbol", False):
                found.setdefault(expr, (i, None, val))
        elif isinstance(val, torch.Tensor):
            for d, size in enumerate(val.shape):
                expr = size_expr(size)
                if getattr(expr, "is_Symbol", False):
                    found.setdefault(expr, (i, d, size))
    return found


def capture_sizes(jg: JointGraph) -> Sizes:
    """The sizes ``jg`` was captured at: its symbols at their hints (empty: static shapes)."""
    symbols = _symbols_of(jg.module)
    return Sizes({s: size_hint(v) for s, (_, _, v) in symbols.items() if s in jg.symbols})


class PlansBySize:
    """The plan of one graph captured with symbolic sizes, at each size it runs.

    Made when the graph is planned (inside the capture): ``planned`` is the plan at the captured
    sizes, with the range its decisions are used for, which this installs as guards. A budget
    shared with the step's other graphs (graph breaks: a byte budget less what earlier graphs
    keep, or the graph's share of the step's budget, ``planning.step_budget``) depends on what those
    graphs keep at each size, which is not known here: such a graph is used at its captured
    sizes only. With ``compiled``, ``plan`` was predicted from its compiled graphs (Inductor):
    at other sizes the simulation is moved by what they held beyond it (``CompiledOffset``).
    """

    def __init__(
        self,
        jg: JointGraph,
        plan: GraphPlan,
        policy: Policy,
        outside: Callable[[int], int] | None,
        *,
        spent_bytes: int = 0,
        shared: bool = False,
        compiled: bool = False,
    ) -> None:
        self.jg = jg
        self.policy = policy
        self.outside = outside
        symbols = {s: v for s, (_, _, v) in _symbols_of(jg.module).items() if s in jg.symbols}
        hints = Sizes({s: size_hint(v) for s, v in symbols.items()})
        self.offset: CompiledOffset | None = None
        if compiled:
            simulated = plan_at(jg, plan, policy, hints, outside=outside)
            self.offset = CompiledOffset.between(plan, simulated)
        shared_budget = policy.budget is not None and (
            shared
            or (policy.budget is not None and policy.budget.fraction is None and spent_bytes > 0)
        )
        if shared_budget or len(symbols) < len(jg.symbols):
            # Sizes this graph cannot read from its inputs, or a budget it shares: one size.
            bounds: dict[Any, tuple[int | None, int | None]] = {s: (v, v) for s, v in hints.items()}
        else:
            bounds = size_range(jg, plan, policy, hints, outside=outside, offset=self.offset)
        for symbol, (lo, hi) in bounds.items():
            value = symbols[symbol]
            # Evaluated on the symbol, each test becomes a guard of the capture (true here).
            if lo is not None and lo > 2 and not bool(value >= lo):
                raise AssertionError(f"{symbol}={hints[symbol]} below its own range [{lo}, {hi}]")
            if hi is not None and not bool(value <= hi):
                raise AssertionError(f"{symbol}={hints[symbol]} above its own range [{lo}, {hi}]")
        self.planned = dataclasses.replace(
            plan,
            sizes=hints.key,
            planned_sizes=hints.key,
            size_range=tuple(sorted((str(s), lo or 2, hi) for s, (lo, hi) in bounds.items())),
        )
        self._plans: OrderedDict[SizeKey, GraphPlan] = OrderedDict({hints.key: self.planned})

    def reader(self, gm: fx.GraphModule) -> Callable[[list[Any]], Sizes] | None:
        """How the forward graph ``gm`` reads its sizes from its arguments (None: it cannot)."""
        sources = _symbols_of(gm)
        if not self.jg.symbols <= sources.keys():
            return None
        wanted = [(s, i, d) for s, (i, d, _) in sources.items() if s in self.jg.symbols]

        def read(args: list[Any]) -> Sizes:
            return Sizes({s: int(args[i] if d is None else args[i].shape[d]) for s, i, d in wanted})

        return read

    def at(self, sizes: Sizes) -> GraphPlan:
        """The plan at ``sizes`` (simulated once per distinct size)."""
        key = sizes.key
        plan = self._plans.get(key)
        if plan is None:
            plan = plan_at(
                self.jg, self.planned, self.policy, sizes, outside=self.outside, offset=self.offset
            )
            self._plans[key] = plan
            if len(self._plans) > CACHED_SIZES:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return plan

    def over_budget(self, plan: GraphPlan, *, spent_bytes: int = 0) -> bool:
        """Whether ``plan`` (from ``at``) exceeds its budget: at a size between the points
        ``size_range`` tried, where peaks did not grow with sizes as assumed (``spent_bytes``:
        what earlier graphs of the step keep)."""
        if self.policy.budget is None:
            return False
        return not holds(self.planned, plan, self.policy, spent_bytes=spent_bytes)
