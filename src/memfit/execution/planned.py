"""A callable (a model's forward or a whole training step) run through memfit's backend.

``memfit.checkpoint`` and ``memfit.step`` differ only in what they compile; what happens around
each call is the same and lives here. Dynamo captures and memfit plans each new input shape;
Dynamo reuses a graph compiled earlier without asking the backend again, so the backend reports
every planned forward graph *when it runs*, and ``plan`` is built from the graphs the last call
ran: returning to a batch size seen before shows that shape's plan, not the last one made.

Shapes are counted here, per wrapper, not by Dynamo: Dynamo's recompile limit (8) counts per
code object, and every compiled module enters through one shared code object, so it was shared
by every model in the process and, once hit, ran new shapes eagerly without a word. memfit
raises Dynamo's limit around its own calls and keeps its own, ``max_shapes`` per wrapper; past
it a new shape runs eagerly *with* a warning, and shapes already planned keep their plans.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from memfit._compat import recompile_limit, tree_flatten
from memfit.capture.graph_breaks import GraphBreakWatcher
from memfit.execution.backend import Offloader, StepBudget, make_backend
from memfit.execution.offload import OffloadError, OffloadOptions, OffloadStore
from memfit.planning.budget import BudgetError
from memfit.planning.plan import GraphPlan, Plan
from memfit.planning.policy import BUDGET, Policy
from memfit.warn import warn_user

__all__ = ["PlannedCall", "DEFAULT_MAX_SHAPES"]

#: Input shapes one wrapper captures and plans before new ones run unplanned (with a warning).
DEFAULT_MAX_SHAPES = 64

#: Dynamo's recompile limit while a memfit wrapper runs: memfit's own ``max_shapes`` binds first.
_DYNAMO_LIMIT = 1 << 16


def planning_error(exc: BaseException) -> BudgetError | OffloadError | None:
    """The BudgetError or OffloadError behind Dynamo's wrapping of backend exceptions, if any."""
    seen = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, (BudgetError, OffloadError)):
            return current
        seen.add(id(current))
        current = (
            getattr(current, "inner_exception", None) or current.__cause__ or current.__context__
        )
    return None


def _needs_backward(out: Any) -> bool:
    leaves, _ = tree_flatten(out)
    return any(isinstance(t, torch.Tensor) and t.grad_fn is not None for t in leaves)


def _no_new(full: bool) -> AbstractContextManager[Any]:
    """Within the shape limit: nothing. Past it: Dynamo runs shapes it has no graph for eagerly.

    ``set_stance`` is refused inside an outer ``torch.compile`` region (``torch.compile`` around
    a memfit wrapper); there the limit is not enforced and new shapes are still planned.
    """
    if not full:
        return contextlib.nullcontext()
    try:
        return torch.compiler.set_stance("eager_on_recompile")  # set now, restored on exit
    except RuntimeError:
        return contextlib.nullcontext()


class PlannedCall:
    """``target`` compiled with memfit's backend under ``policy``; ``plan`` is the last call's."""

    def __init__(
        self,
        target: Callable[..., Any],
        policy: Policy,
        *,
        name: str,
        attention: str = "auto",
        offload: OffloadOptions | None = None,
        max_shapes: int = DEFAULT_MAX_SHAPES,
    ) -> None:
        if isinstance(max_shapes, bool) or not isinstance(max_shapes, int) or max_shapes < 1:
            raise ValueError(f"max_shapes must be a positive int, got {max_shapes!r}")
        self.policy = policy
        self.name = name
        self.max_shapes = max_shapes
        self.shapes_planned = 0
        self.last_plan: Plan | None = None
        self.unplanned: str | None = None  # why the last training call ran without a plan
        self.watcher = GraphBreakWatcher(name)
        self.step_budget = StepBudget() if policy.name == BUDGET else None
        self.offloader = Offloader(offload or OffloadOptions()) if policy.offload else None
        self._made: list[GraphPlan] = []  # plans made during the current call
        self._ran: list[GraphPlan] = []  # planned graphs run by the current call, in order
        self._warned_unplanned = False
        self.compiled = torch.compile(
            target,
            backend=make_backend(
                policy,
                self._made.append,
                self.step_budget,
                attention,
                self.offloader,
                on_run=self._ran.append,
            ),
            dynamic=False,
        )

    @property
    def offload_store(self) -> OffloadStore | None:
        return self.offloader.store if self.offloader else None

    @property
    def plan(self) -> Plan:
        if self.last_plan is None:
            raise RuntimeError(
                self.unplanned
                or f"memfit has not planned {self.name} yet: the plan is made when it is first "
                "called with inputs that require a backward (a training step); call it once first"
            )
        return self.last_plan

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.step_budget is not None:
            self.step_budget.spent = 0
        if self.offloader is not None:
            self.offloader.spent = 0
        self._made.clear()
        self._ran.clear()
        full = self.shapes_planned >= self.max_shapes
        try:
            with self.watcher.watch() as report, recompile_limit(_DYNAMO_LIMIT), _no_new(full):
                out = self.compiled(*args, **kwargs)
        except Exception as exc:
            error = planning_error(exc)
            if error is not None:
                raise error.with_traceback(None) from None
            raise
        finally:
            made = bool(self._made)
            self._made.clear()
        if made:
            self.shapes_planned += 1
        if self._ran:
            self.last_plan = Plan(policy=self.policy.name, graphs=tuple(self._ran))
            self.unplanned = None
        elif torch.is_grad_enabled() and _needs_backward(out):
            self._ran_unplanned(full)
        if report.broke:
            report.warn_once()
        return out

    def _ran_unplanned(self, full: bool) -> None:
        """A training call ran none of memfit's graphs: say so, and keep no stale plan."""
        if full:
            why = (
                f"memfit has planned {self.shapes_planned} input shapes for {self.name} "
                f"(max_shapes={self.max_shapes}) and ran this new one as plain PyTorch, without a "
                "plan or savings; pad or bucket inputs to fewer shapes, or raise max_shapes"
            )
        else:
            why = (
                f"{self.name} ran as plain PyTorch, without a plan or savings: torch.compile "
                "did not run memfit's graphs for this call (see TORCH_LOGS=recompiles)"
            )
        self.last_plan = None
        self.unplanned = why
        if not self._warned_unplanned:
            self._warned_unplanned = True
            warn_user(why)
