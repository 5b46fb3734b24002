"""A callable (a model's forward or a whole training step) run through memfit's backend.

``memfit.checkpoint`` and ``memfit.step`` differ only in what they compile; what happens around
each call is the same: ``PlannedCall`` runs the target compiled with memfit's backend, and its
``CallSession`` (``execution.session``) holds everything the calls learn and decide (the plans,
the captures counted, what the step held outside the graphs, the chain, the regions, when to plan
again) and is what the backend reports to.

Dynamo captures and memfit plans the first input shape; when a size changes, Dynamo captures once
more with that dimension as a symbol (automatic dynamic shapes), and that graph serves every size
in the range its plan holds for (NOTE [One capture for many sizes] in ``planning.resize``): a new
sequence length costs a few milliseconds of simulation instead of a capture (seconds). Captures
are counted by the session, per wrapper, not by Dynamo: memfit raises Dynamo's limit around its
own calls and keeps its own, ``max_shapes`` captures per wrapper; past it a call that needs a new
capture runs eagerly (``_no_new``), with a warning.

A wrapped model (``modules``) whose graph breaks lie inside submodules has those submodules
recomputed whole from the next call on (``execution.regions``), compiled by a second backend that
plans with ``"none"`` (``BackendSettings.in_regions``).

Randomness the model draws in its own Python is drawn as plain PyTorch draws it: Dynamo leaves
``numpy.random`` calls to Python while a call runs (``numpy_random_in_python``; by default it
would trace them as draws from torch's generator), and every forward memfit runs besides the
user's step puts back Python's and numpy's random states as well as torch's (NOTE [ Random
streams a forward draws from ] in ``execution.state``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn as nn

from memfit._compat import (
    accumulated_recompile_limit,
    compile_with_recompile_limit,
    numpy_random_in_python,
    traced_logging,
)
from memfit.execution.backend import make_backend
from memfit.execution.offload import OffloadError, OffloadStore
from memfit.execution.options import Executor, Options
from memfit.execution.regions import DYNAMO_RECOMPILE_LIMIT
from memfit.execution.run_chain import recording
from memfit.execution.session import STEP_ROUNDS, CallSession, InRegion
from memfit.planning.budget import BudgetError
from memfit.planning.plan import Plan
from memfit.planning.policy import Policy

__all__ = ["PlannedCall", "PlannedView", "STEP_ROUNDS", "memfit_call_running"]

_running = 0  # memfit calls (models memfit is applied to, steps) now running on the stack


def memfit_call_running() -> bool:
    """Whether a memfit call (a model's or a step's) is running: asked, while Dynamo traces, by
    the forward of a submodule memfit is also applied to (``Checkpointing.__call__``), which is
    then captured as part of the outer call's graphs."""
    return _running > 0


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


def _no_new(full: bool) -> AbstractContextManager[Any]:
    """Within the shape limit: nothing. Past it: Dynamo runs shapes it has no graph for eagerly.

    ``set_stance`` is refused while Dynamo traces; memfit's call is excluded from an outer
    ``torch.compile`` (it runs eagerly, around the wrapper's own compile), so the refusal is only
    a safety net.
    """
    if not full:
        return contextlib.nullcontext()
    try:
        return torch.compiler.set_stance("eager_on_recompile")  # set now, restored on exit
    except RuntimeError:
        return contextlib.nullcontext()


class PlannedCall:
    """``target`` compiled with memfit's backend under ``policy``; ``plan`` is the last call's.

    The callable users' calls go through; its ``session`` (``execution.session``) is everything
    the calls learn and decide."""

    def __init__(
        self,
        target: Callable[..., Any],
        policy: Policy,
        options: Options,
        executor: Executor,
        *,
        name: str,
        modules: nn.Module | None = None,
    ) -> None:
        self.session = CallSession(name, policy, options, executor, modules)
        self._target = target
        self.compiled = self._compile()

    def _compile(self) -> Callable[..., Any]:
        """The target compiled with a new backend (so Dynamo captures every shape again)."""
        session = self.session
        backend = make_backend(session.settings, session)
        if session.regions is not None:
            # Inside a region its recomputation is the one recomputation: keep all a graph's
            # backward reads (execution.regions).
            session.regions.use(make_backend(session.settings.in_regions(), InRegion(session)))
        # None: a dimension that changes between calls is captured again once, as a symbol, and
        # that graph serves every size in its range (NOTE [One capture for many sizes]). Offload
        # plans reserve host memory for one size: they are captured per size.
        return compile_with_recompile_limit(
            self._target,
            backend=backend,
            dynamic=False if session.policy.offload else None,
            limit=DYNAMO_RECOMPILE_LIMIT,
        )

    @property
    def name(self) -> str:
        return self.session.name

    @property
    def policy(self) -> Policy:
        return self.session.policy

    @property
    def shapes_planned(self) -> int:
        """Captures planned so far: an input shape, or a range of sizes captured as symbols."""
        return len(self.session.captures.shapes)

    @property
    def regions_changed(self) -> bool:
        return self.session.regions_changed

    @property
    def replan_pending(self) -> bool:
        """Whether the next call captures and plans again (a step held more outside memfit's
        graphs than its plan allowed for), or the next call outside a CPU profiler session does
        (graphs compiled by Inductor inside one, which could not be measured)."""
        return self.session.replan_pending

    @property
    def offload_store(self) -> OffloadStore | None:
        offloader = self.session.settings.offloader
        return offloader.store if offloader else None

    @property
    def plan(self) -> Plan:
        session = self.session
        if session.last_plan is None:
            raise RuntimeError(
                session.unplanned
                or f"memfit has not planned {session.name} yet: the plan is made when it is "
                "first called with inputs that require a backward (a training step); call it "
                "once first"
            )
        return session.last_plan

    # An outer torch.compile (around a memfit wrapper or step) steps around memfit's call: its
    # Python is memfit's bookkeeping, not the user's model. Converted by the outer compile frame
    # by frame (56 frames on a wrapped MLP's first call, 8 more each step), it could hold the
    # model's output into the backward (128 KiB above the plan). The target itself is still
    # compiled, by memfit's own torch.compile.
    @torch.compiler.disable
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """The call, for a caller Dynamo already steps around (``CheckpointedModule._call``):
        each ``torch.compiler.disable`` entered costs a step microseconds."""
        session = self.session
        if session.replans_now():
            self.compiled = self._compile()
        call = session.start(_device_of(args, kwargs))
        global _running
        _running += 1
        try:
            with (
                session.watcher.watch() as report,
                accumulated_recompile_limit(DYNAMO_RECOMPILE_LIMIT),
                traced_logging(),
                numpy_random_in_python(),
                _no_new(call.full),
                call.regions,
                recording(call.chain),
            ):
                out = self.compiled(*args, **kwargs)
        except Exception as exc:
            error = planning_error(exc)
            if error is not None:
                raise error.with_traceback(None) from None
            raise
        finally:
            _running -= 1
            session.end(call)
        session.finish(call, out, report)
        return out


class PlannedView:
    """What a model memfit is applied to (``model.memfit``) and a ``memfit.step`` both show of
    their ``PlannedCall`` (``_planned``)."""

    _planned: PlannedCall

    @property
    def policy(self) -> Policy:
        """The policy the calls are planned with."""
        return self._planned.policy

    @property
    def plan(self) -> Plan:
        """The plan of the graphs the last training call ran (each input shape has its own)."""
        return self._planned.plan

    @property
    def offload_store(self) -> OffloadStore | None:
        """Where the offloaded activations live (None until a plan offloads)."""
        return self._planned.offload_store

    @property
    def replan_pending(self) -> bool:
        """Whether the next training call captures and plans again, reserving what the last
        step was measured to hold outside memfit's graphs (a loss computed outside the model;
        ``memfit.Options.measure_outside``)."""
        return self._planned.replan_pending


def _device_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device | None:
    """The device of a call's first tensor argument (where its memory is measured), if any."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device
    return None
