"""A callable (a model's forward or a whole training step) run through memfit's backend.

``memfit.checkpoint`` and ``memfit.step`` differ only in what they compile; what happens around
each call is the same and lives here. Dynamo captures and memfit plans the first input shape;
when a size changes, Dynamo captures once more with that dimension as a symbol (automatic dynamic
shapes), and that graph serves every size in the range its plan holds for (NOTE [One capture for
many sizes] in ``planning.resize``): a new sequence length costs a few milliseconds of simulation
instead of a capture (seconds). Dynamo reuses a graph compiled earlier without asking the backend
again, so the backend reports every planned forward graph *when it runs*, with the plan at the
sizes it ran at, and ``plan`` is built from the graphs the last call ran: returning to a batch size
seen before shows that size's plan, not the last one made.

Captures are counted here, per wrapper, not by Dynamo: Dynamo's recompile limit (8) counts per
code object, and every compiled module enters through one shared code object, so it was shared
by every model in the process and, once hit, ran new shapes eagerly without a word. memfit
raises Dynamo's limit around its own calls and keeps its own, ``max_shapes`` captures per
wrapper; past it a call that needs a new capture runs eagerly *with* a warning, and what was
captured before keeps its plans.

A wrapped model (``modules``) whose graph breaks lie inside submodules has those submodules
recomputed whole from the next call on (``execution.regions``): the backend reports each graph
as Dynamo hands it over, while the modules around it are still running, and the call installs
the regions it has chosen; the plan lists each region call.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn as nn

from memfit._compat import (
    accumulated_recompile_limit,
    compile_with_recompile_limit,
    traced_logging,
    tree_flatten,
)
from memfit.analysis.graph import BackwardStart
from memfit.capture.graph_breaks import GraphBreakReport, GraphBreakWatcher
from memfit.execution.backend import make_backend
from memfit.execution.call_messages import (
    INDUCTOR_BUDGET_WARNING,
    break_action,
    loss_outside_unseen,
    swap_saved_little,
    unplanned,
)
from memfit.execution.chain import StepChain, chains, recording
from memfit.execution.chain_state import ChainState
from memfit.execution.executors import INDUCTOR
from memfit.execution.offload import Offloader, OffloadError, OffloadStore
from memfit.execution.options import Executor, Options
from memfit.execution.partitioner import StepBudget
from memfit.execution.regions import DYNAMO_RECOMPILE_LIMIT, Regions
from memfit.measurement.cpu import cpu_recording_blocked
from memfit.measurement.window import MemoryWindow
from memfit.planning.budget import BudgetError
from memfit.planning.chain import ChainRun, ChainValue
from memfit.planning.plan import GraphPlan, Plan
from memfit.planning.policy import Policy
from memfit.planning.step_budget import (
    GraphShare,
    least_step_peak,
    planned_as_step,
    share_step,
    step_budget_bytes,
)
from memfit.units import format_bytes
from memfit.warn import warn_user

__all__ = ["PlannedCall", "PlannedView", "STEP_ROUNDS", "memfit_call_running"]

#: How graphs inside a region are planned: its recomputation is the one recomputation.
NONE = Policy("none")

_running = 0  # memfit calls (models memfit is applied to, steps) now running on the stack


def memfit_call_running() -> bool:
    """Whether a memfit call (a model's or a step's) is running: asked, while Dynamo traces, by
    the forward of a submodule memfit is also applied to (``Checkpointing.__call__``), which is
    then captured as part of the outer call's graphs."""
    return _running > 0


#: Times a graph is planned again for what its first backwards showed of the caller
#: (``execution.start_watch``): a loop can change how it steps once (a first epoch, then
#: another), not forever.
START_REPLANS = 2

#: Times a step with graph breaks is planned again as a whole before memfit says it cannot.
STEP_ROUNDS = 3


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


def _starts_training(out: Any) -> bool:
    """Whether a call that returned ``out`` starts a training step. It flattens the output, so
    a call asks only where the answer decides something, not on every step."""
    if not torch.is_grad_enabled():
        return False
    leaves, _ = tree_flatten(out)
    return any(isinstance(t, torch.Tensor) and t.grad_fn is not None for t in leaves)


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


def _output_device(out: Any) -> str | None:
    leaves, _ = tree_flatten(out)
    return next((t.device.type for t in leaves if isinstance(t, torch.Tensor)), None)


class PlannedCall:
    """``target`` compiled with memfit's backend under ``policy``; ``plan`` is the last call's."""

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
        if policy.autotune and executor != INDUCTOR:
            raise ValueError(
                "Options(autotune=True) times plans as Inductor compiles them: use "
                "executor='inductor'"
            )
        if executor == INDUCTOR and policy.budget is not None and policy.offload:
            warn_user(INDUCTOR_BUDGET_WARNING)
        self.policy = policy
        self.name = name
        self.executor = executor
        self.max_shapes = options.max_shapes
        self.measure_outside = options.measure_outside
        self.last_plan: Plan | None = None
        self.unplanned: str | None = None  # why the last training call ran without a plan
        #: bytes measured outside memfit's graphs between forward and backward, by graph key,
        #: with the bytes of the graph's outputs at the size measured (what it is scaled by)
        self.outside: dict[str, tuple[int, int]] = {}
        #: the start of each graph's backward seen on its first step (``execution.start_watch``)
        self.starts: dict[str, BackwardStart] = {}
        #: how many times each graph was planned again for the start of its backward
        self._replanned_for_start: dict[str, int] = {}
        self.watcher = GraphBreakWatcher(name)
        self.step_budget = StepBudget() if policy.budget is not None else None
        self.offloader = Offloader(options) if policy.offload else None
        self._target = target
        self._attention = str(options.attention)
        self._loss_head = str(options.loss_head)
        self._shapes: set[tuple[str, ...]] = set()  # what each capturing call planned
        self._keys: set[str] = set()  # every graph (and size range) planned
        self._made: list[GraphPlan] = []  # plans made during the current call
        self._ran: list[GraphPlan] = []  # planned graphs run by the current call, in order
        self._window: MemoryWindow | None = None
        self._replan = False
        #: a graph of the last capture was compiled inside a CPU profiler session, so its peaks
        #: are Inductor's schedule's, not measured: plan again on a call outside one
        self._measure_later = False
        self._warned_unplanned = False
        self._warned_outside = False
        self._warned_budget = False
        self._warned_swap = False
        self._warned_unmeasured_outside = False
        #: per graph and sizes (``GraphPlan.sized_key``), once its step was planned as a whole:
        #: its share of the step's budget
        self._shares: dict[str, GraphShare] = {}
        self._step_rounds: dict[tuple[str, ...], int] = {}
        self._warned_step = False
        #: submodules with graph breaks, recomputed whole (a wrapped model only)
        self.regions = (
            Regions(modules, policy, self._ran, self._close_window) if modules is not None else None
        )
        #: the regions changed at the end of the last call (they apply from the next one)
        self.regions_changed = False
        #: the chain of graph runs across the calls (``execution.chain_state``), and the
        #: current call's
        self.chain = ChainState(policy)
        self._chain: StepChain | None = None
        self.compiled = self._compile()

    def _compile(self) -> Callable[..., Any]:
        """The target compiled with a new backend (so Dynamo captures every shape again)."""
        reports: dict[str, Any] = dict(
            on_run=self._graph_ran,
            on_backward=self._backward_started,
            outside_bytes=self._outside_bytes,
            on_compile=self.regions.compiling if self.regions is not None else None,
            on_unmeasured=self._unmeasured,
            backward_start=self.starts.get,
            on_backward_start=self._backward_start_seen,
        )
        backend = make_backend(
            self.policy,
            self._made.append,
            self.step_budget,
            self._attention,
            self.offloader,
            share=lambda key: self._shares.get(key),
            on_budget_miss=self._budget_missed,
            executor=self.executor,
            chain_mode=lambda: self.chain.mode(self._chains()),
            loss_head=self._loss_head,
            **reports,
        )
        if self.regions is not None:
            # Inside a region its recomputation is the one recomputation: keep all a graph's
            # backward reads (execution.regions). Not part of the step budget: what these graphs
            # keep lives only while their region is recomputed.
            self.regions.use(
                make_backend(
                    NONE,
                    self._made.append,
                    None,
                    self._attention,
                    None,
                    executor=self.executor,
                    loss_head=self._loss_head,
                    **reports,
                )
            )
        # None: a dimension that changes between calls is captured again once, as a symbol, and
        # that graph serves every size in its range (NOTE [One capture for many sizes]). Offload
        # plans reserve host memory for one size: they are captured per size.
        return compile_with_recompile_limit(
            self._target,
            backend=backend,
            dynamic=False if self.policy.offload else None,
            limit=DYNAMO_RECOMPILE_LIMIT,
        )

    def _graph_ran(self, graph: GraphPlan) -> None:
        self._ran.append(graph)
        if self._chain is not None:
            self._chain.reported(graph)
        if self.regions is not None:
            self.regions.graph_ran()

    def _outside_bytes(self, key: str, output_bytes: int) -> int:
        """What the step held outside graph ``key`` between forward and backward, scaled from
        the size it was measured at by the bytes of the graph's outputs (a loss computed from
        them holds a multiple of them)."""
        measured, measured_output = self.outside.get(key, (0, 0))
        if not measured_output:
            return measured
        return round(measured * output_bytes / measured_output)

    def _backward_start_seen(self, key: str, seen: BackwardStart, material: bool) -> None:
        """Graph ``key``'s first backward started otherwise than its plan assumed (the caller
        held other outputs, or other outputs got a gradient): plan it with what was seen from
        the next call where that moves its peak materially (at most ``START_REPLANS`` times
        per graph), else from its next plan made for another reason."""
        self.starts[key] = seen
        if material and self._replanned_for_start.get(key, 0) < START_REPLANS:
            self._replanned_for_start[key] = self._replanned_for_start.get(key, 0) + 1
            self._replan = True

    def _unmeasured(self) -> None:
        """A graph was compiled inside a CPU profiler session (``memfit.measure`` around the
        first call) and could not be measured: plan again on the first call outside one.

        Why: a plan's peaks under Inductor are measured once compiled; without that they are
        Inductor's schedule's estimate, and nothing else would ever replace it. Measured on the
        zoo's U-Net under ``"memory"``, first called inside ``memfit.measure``: every later step
        peaked at 1.37 MiB against 1.01 predicted (``docs/measurements.md``),
        and a budget checked against the estimate is not guaranteed."""
        self._measure_later = True

    def _budget_missed(self, plan: GraphPlan) -> None:
        """A graph planned for a range of sizes exceeds its budget at the size that just ran."""
        self._replan = True
        if not self._warned_budget:
            self._warned_budget = True
            sizes = ", ".join(f"{name}={value}" for name, value in plan.sizes)
            chosen = ", ".join(f"{name}={value}" for name, value in plan.planned_sizes)
            warn_user(
                f"{self.name}'s plan, chosen at {chosen}, predicts "
                f"{format_bytes(plan.predicted_peak_bytes)} at {sizes}, above its budget of "
                f"{format_bytes(plan.budget_bytes or 0)}; memfit plans again from the next call"
            )

    @property
    def shapes_planned(self) -> int:
        """Captures planned so far: an input shape, or a range of sizes captured as symbols."""
        return len(self._shapes)

    @property
    def replan_pending(self) -> bool:
        """Whether the next call captures and plans again (a step held more outside memfit's
        graphs than its plan allowed for), or the next call outside a CPU profiler session does
        (graphs compiled by Inductor inside one, which could not be measured)."""
        return self._replan or self._measure_later

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
        if self._window is not None:  # the last call's backward never started
            self._window.abandon()
            self._window = None
        full = self.shapes_planned >= self.max_shapes
        if self._measure_later and cpu_recording_blocked() is None:
            self._measure_later = False
            self._replan = True
        if self._replan and not full:
            self.compiled = self._compile()
            self._replan = False
        if self.step_budget is not None:
            self.step_budget.spent = 0
        if self.offloader is not None:
            self.offloader.spent = 0
        self._made.clear()
        self._ran.clear()
        regions = self.regions.installed() if self.regions else contextlib.nullcontext()
        # A chain needs two graph runs: after a call that ran one, none is recorded (a call that
        # runs more from then on is one unplanned by the chain, and the next is).
        several = self.last_plan is None or len(self.last_plan.graphs) > 1
        chain = self._chain = StepChain(self.chain.rule) if several and self._chains() else None
        self.chain.next = None
        chained: tuple[list[ChainRun], list[ChainValue]] | None = None
        global _running
        _running += 1
        try:
            with (
                self.watcher.watch() as report,
                accumulated_recompile_limit(DYNAMO_RECOMPILE_LIMIT),
                traced_logging(),
                _no_new(full),
                regions,
                recording(chain),
            ):
                out = self.compiled(*args, **kwargs)
        except Exception as exc:
            error = planning_error(exc)
            if error is not None:
                raise error.with_traceback(None) from None
            raise
        finally:
            _running -= 1
            if chain is not None:
                chained = chain.seal()
                self._chain = None
            # A graph and its input shapes, and for a graph with symbolic sizes the range it was
            # planned for: capturing it again for another range counts again.
            made = tuple(sorted(f"{p.key}{p.size_range}" for p in self._made))
            self._made.clear()
        if made and not self._keys.issuperset(made):  # not a region's graphs planned again
            self._shapes.add(made)
        self._keys.update(made)

        # Regions found in this call change the step from the next call on: check it then.
        self.regions_changed = self.regions is not None and self.regions.decide()
        if self._ran:
            ran, last = self._ran, self.last_plan
            calls = tuple(self.regions.calls) if self.regions is not None else ()
            # The same graphs as the last call: the same Plan object (callers compare plans).
            if (
                last is None
                or len(last.graphs) != len(ran)
                or any(a is not b for a, b in zip(last.graphs, ran))
                or last.regions != calls
            ):
                self.last_plan = Plan(policy=self.policy.name, graphs=tuple(ran), regions=calls)
            if chained is not None and _starts_training(out):
                self._after_chain(*chained, settled=not made)
            self.unplanned = None
            if (
                self.measure_outside
                and ran[-1].key not in self.outside
                and MemoryWindow.can_open()
                and _starts_training(out)
            ):
                self._open_window(out)
            budget = self.policy.budget is not None and not self.regions_changed
            if made and budget and self.last_plan is not None and _starts_training(out):
                self._check_step(self.last_plan)
            if made and self.last_plan is not None:
                self._say_what_cannot_act(self.last_plan, out)
        elif _starts_training(out):
            self._ran_unplanned(full, report)
        if report.broke:
            report.warn_once(break_action(self.regions, self.policy, self._chains()))
        return out

    def _chains(self) -> bool:
        """Whether this call's graph runs form a chain (``execution.chain.chains``), and not
        where regions recompute submodules whole (their graphs run again as Python, which a
        chain cannot replay)."""
        return chains(self.policy, self.executor) and (
            self.regions is None or not self.regions.chosen
        )

    def _after_chain(
        self, runs: list[ChainRun], values: list[ChainValue], *, settled: bool
    ) -> None:
        """The chain of the call that just ran (``settled``: it captured nothing): the rule
        the next call runs by, the plan's chain, and a budget the chain cannot hold refused."""
        plan = self.last_plan
        if plan is None:
            return
        outcome = self.chain.after_call(runs, values, plan, settled)
        if outcome.replan:
            self._replan = True
        if outcome.shown is not None and plan.chain != outcome.shown:
            self.last_plan = dataclasses.replace(plan, chain=outcome.shown)
        if outcome.refuse is not None:
            assert self.chain.budget is not None
            self._refuse_step(plan, self.chain.budget, outcome.refuse)

    def _say_what_cannot_act(self, plan: Plan, out: Any) -> None:
        """Once each, after a call that planned: a policy that could not act here, and a budget
        that cannot cover what the caller's code holds.

        Why: measured on CPU (2 threads, no copy overlaps compute), ``"swap"`` offloaded nothing
        on a MobileNet-like net and peaked at plain's 1.00x without a word; and a tied-weight
        GRU LM with its cross-entropy outside the module peaked at 1.44x its ``budget=`` from
        the second step on, with no warning, because on CPU memfit measures what the caller
        holds between forward and backward only inside ``memfit.measure``."""
        said = swap_saved_little(self.name, plan.offloaded_bytes, plan.kept_bytes)
        if self.policy.swaps and said is not None and not self._warned_swap:
            self._warned_swap = True
            warn_user(said)
        if (
            self.policy.budget is not None
            and self.measure_outside
            and not self._warned_unmeasured_outside
            and not any(g.outside_bytes for g in plan.graphs)
            and not plan.graphs[-1].returns_loss
            and _output_device(out) == "cpu"
            and not MemoryWindow.can_open()
            and _starts_training(out)
        ):
            self._warned_unmeasured_outside = True
            warn_user(loss_outside_unseen(self.name, plan.graphs[-1].output_bytes))

    def _open_window(self, out: Any) -> None:
        """Measure what the caller's code holds between this forward and its backward."""
        leaves, _ = tree_flatten(out)
        device = next((t.device for t in leaves if isinstance(t, torch.Tensor)), None)
        plan = self.last_plan
        if device is None or plan is None:
            return
        self._window = MemoryWindow.open(device, lambda peak: self._measured_outside(plan, peak))

    def _backward_started(self, graph: GraphPlan) -> None:
        """A backward graph starts: the code between forward and backward is done."""
        self._close_window()

    def _close_window(self) -> None:
        """The backward starts (a backward graph, or a region's recomputation before it)."""
        window, self._window = self._window, None
        if window is not None:
            window.close()

    def _measured_outside(self, plan: Plan, outside: int) -> None:
        """The step held ``outside`` bytes between ``plan``'s forward and backward: remember it
        for the graph, and plan again if that peak is above what the plan allowed for."""
        last = plan.graphs[-1]
        self.outside[last.key] = (outside, last.output_bytes)
        step_peak = plan.forward_end_bytes + outside
        if step_peak <= 1.01 * plan.predicted_peak_bytes:
            return
        self._replan = True
        if not self._warned_outside:
            self._warned_outside = True
            warn_user(
                f"the training step held {format_bytes(outside)} outside memfit's graphs of "
                f"{self.name} between its forward and backward (a loss computed outside the "
                f"model, or other code), so it peaked near {format_bytes(step_peak)} against "
                f"{format_bytes(plan.predicted_peak_bytes)} predicted; memfit plans {self.name} "
                f"again with that reserved, so its budget and prediction hold from the next "
                f"call. Compute the loss inside memfit.step to plan it too."
            )

    def _check_step(self, plan: Plan) -> None:
        """After a call that planned graphs: does the step fit its budget as a whole?

        One graph: its plan was made against the step's budget, and a fraction it could not
        meet is an error now (``planning.planner``'s ``first_plan``). Several graphs (graph
        breaks): unless they were planned together and fit, memfit chooses one plan per graph
        from their frontiers for the whole step (``planning.step_budget``) and plans each graph
        again with its share on the next call; BudgetError, now, if no combination fits."""
        assert self.policy.budget is not None
        if len(plan.graphs) == 1:
            graph = plan.graphs[0]
            if graph.budget_bytes is not None and graph.predicted_peak_bytes > graph.budget_bytes:
                self._fail()
                raise BudgetError(
                    f"no plan fits a budget of {format_bytes(graph.budget_bytes)}: the smallest "
                    f"peak memfit can reach for this graph is "
                    f"{format_bytes(graph.predicted_peak_bytes)} "
                    f"({graph.predicted_peak_bytes} bytes)",
                    budget_bytes=graph.budget_bytes,
                    least_bytes=graph.predicted_peak_bytes,
                )
            return
        budget = step_budget_bytes(self.policy.budget, plan)
        if self.chain.budget is not None and self.chain.next is not None:
            return  # the chain holds the budget (execution.chain_state)
        if planned_as_step(plan, budget):
            return
        shares = share_step(plan, budget)
        if shares is None and self.chain.next is not None:
            # No plans of the graphs fit it together: from the next call the chain holds it.
            self.chain.hold(self.policy.budget, plan)
            self._replan = True
            return
        if shares is None:
            self._refuse_step(plan, budget, least_step_peak(plan))
        step = tuple(g.sized_key for g in plan.graphs)
        rounds = self._step_rounds.get(step, 0)
        if rounds >= STEP_ROUNDS:
            if plan.predicted_peak_bytes > budget and not self._warned_step:
                self._warned_step = True
                warn_user(
                    f"{self.name} runs in {len(plan.graphs)} graphs (graph breaks) and memfit "
                    f"could not bring the whole step within its budget of "
                    f"{format_bytes(budget)}: predicted peak "
                    f"{format_bytes(plan.predicted_peak_bytes)}. Remove the graph breaks or "
                    f"give a larger budget."
                )
            return
        if not shares:  # every graph is inside a region: nothing to plan again
            return
        self._step_rounds[step] = rounds + 1
        self._shares.update(shares)
        self._replan = True

    def _refuse_step(self, plan: Plan, budget: int, smallest: int) -> None:
        """BudgetError for a step of several graphs that no plan brings within ``budget``."""
        self._fail()
        raise BudgetError(
            f"no plan fits a budget of {format_bytes(budget)}: {self.name} runs in "
            f"{len(plan.graphs)} graphs (graph breaks), and the smallest peak memfit can "
            f"reach for the whole step is {format_bytes(smallest)} ({smallest} bytes)",
            budget_bytes=budget,
            least_bytes=smallest,
        )

    def _fail(self) -> None:
        """The graphs just compiled were planned over budget: none of them may run again."""
        self._replan = True
        if self._window is not None:
            self._window.abandon()
            self._window = None

    def _ran_unplanned(self, full: bool, report: GraphBreakReport) -> None:
        """A training call ran none of memfit's graphs: say so, and keep no stale plan."""
        why = unplanned(self.name, full, self.shapes_planned, self.max_shapes, report)
        if report.frame_skipped:
            self.watcher.warned = True  # the one warning says both: the break, and the skip
        self.last_plan = None
        self.unplanned = why
        if not self._warned_unplanned:
            self._warned_unplanned = True
            warn_user(why)


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
