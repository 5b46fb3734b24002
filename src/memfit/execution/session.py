"""A call session: what every training call of a memfit-applied model (or step) goes through.

Capture, plan, run, observe, replan: ``execution.planned_call.PlannedCall`` runs the compiled
target, and everything it learns or decides around that lives here, in one object with explicit
state. The backend (``execution.backend``) reports to the session through one interface
(``execution.events.BackendEvents``), which ``CallSession`` implements; the session holds the one
``BackendSettings`` the backend plans by (``execution.settings``: the policy, stored once), and
gives its warnings through one ``CallWarnings`` (``execution.call_messages``), each once.

What the session keeps from call to call, each part a small record:

* ``captures`` (``_Captures``): memfit's own count of captures, ``max_shapes`` per wrapper.
  Dynamo's recompile limit (8) counts per code object, and every compiled module enters through
  one shared code object, so it was shared by every model in the process and, once hit, ran new
  shapes eagerly without a word; past memfit's own a call that needs a new capture runs eagerly
  *with* a warning, and what was captured before keeps its plans.
* ``outside`` (``_Outside``): what the caller's code held between a forward and its backward (a
  loss computed outside the model), measured once per graph and reserved by its next plan.
* ``levels`` (``_Levels``): with graph breaks, what the step held when each part's forward
  started beyond what the parts before it predict (the model's Python between graphs), measured
  once per sequence of graphs and added to the plan's prediction (``Plan.held``).
* ``starts`` (``_Starts``): the start of each graph's backward seen on its first step
  (``execution.start_watch``), planned for from the next capture.
* ``step`` (``_StepShares``): a budget shared by a step's several graphs (graph breaks), the
  step planned as a whole (``planning.step_budget``).
* ``chain`` (``execution.chain_state``): the chain of the step's graph runs.
* ``regions`` (``execution.regions``): submodules with graph breaks inside, recomputed whole.
* ``replan`` and ``measure_later``: whether the next call captures and plans again.

Dynamo reuses a graph compiled earlier without asking the backend again, so the backend reports
every planned forward graph *when it runs*, with the plan at the sizes it ran at, and the plan
is built from the graphs the last call ran: returning to a batch size seen before shows that
size's plan, not the last one made.
"""

from __future__ import annotations

import contextlib
import dataclasses
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn as nn

from memfit._compat import tree_flatten
from memfit.analysis.graph import BackwardStart
from memfit.capture.graph_breaks import GraphBreakReport, GraphBreakWatcher
from memfit.execution.call_messages import (
    INDUCTOR_BUDGET_WARNING,
    CallWarnings,
    Once,
    break_action,
    budget_missed,
    held_outside,
    loss_outside_unseen,
    step_over_budget,
    swap_saved_little,
    unplanned,
)
from memfit.execution.chain_state import ChainState
from memfit.execution.executors import INDUCTOR
from memfit.execution.offload import Offloader
from memfit.execution.options import Executor, Options
from memfit.execution.regions import Regions
from memfit.execution.run_chain import StepChain, chains
from memfit.execution.settings import BackendSettings, StepBudget
from memfit.execution.step_check import STEP_ROUNDS, StepShares, refused_step
from memfit.measurement.cpu import cpu_recording_blocked
from memfit.measurement.window import MemoryLevels, MemoryWindow
from memfit.planning.plan import GraphPlan, Plan
from memfit.planning.plan_chain import ChainRun, ChainValue
from memfit.planning.policy import Policy
from memfit.planning.step_budget import GraphShare

__all__ = ["CallSession", "InRegion", "START_REPLANS", "STEP_ROUNDS"]

#: Times a graph is planned again for what its first backwards showed of the caller
#: (``execution.start_watch``): a loop can change how it steps once (a first epoch, then
#: another), not forever.
START_REPLANS = 2


def _starts_training(out: Any) -> bool:
    """Whether a call that returned ``out`` starts a training step. It flattens the output, so
    a call asks only where the answer decides something, not on every step."""
    if not torch.is_grad_enabled():
        return False
    leaves, _ = tree_flatten(out)
    return any(isinstance(t, torch.Tensor) and t.grad_fn is not None for t in leaves)


def _output_device(out: Any) -> str | None:
    leaves, _ = tree_flatten(out)
    return next((t.device.type for t in leaves if isinstance(t, torch.Tensor)), None)


@dataclasses.dataclass
class _Captures:
    """The captures a session planned: memfit's own count of them, at most ``limit``."""

    limit: int  # Options.max_shapes
    #: what each capturing call planned: its graphs, with their shapes or size ranges
    shapes: set[tuple[str, ...]] = dataclasses.field(default_factory=set)
    #: every graph (and size range) planned
    keys: set[str] = dataclasses.field(default_factory=set)
    #: the plans made during the current call
    made: list[GraphPlan] = dataclasses.field(default_factory=list)

    @property
    def full(self) -> bool:
        """Whether the next capture is one too many (it runs eagerly, with a warning)."""
        return len(self.shapes) >= self.limit

    def taken(self) -> tuple[str, ...]:
        """The plans the current call made, by graph and input shapes, and for a graph with
        symbolic sizes the range it was planned for (capturing it again for another range
        counts again); cleared for the next call."""
        made = tuple(sorted(f"{p.key}{p.size_range}" for p in self.made))
        self.made.clear()
        return made

    def count(self, made: tuple[str, ...]) -> None:
        """Count a call's plans (``taken``) as one capture, unless they are a region's graphs
        planned again (keys planned before)."""
        if made and not self.keys.issuperset(made):
            self.shapes.add(made)
        self.keys.update(made)


@dataclasses.dataclass
class _Outside:
    """What the caller's code held between a graph's forward and its backward, by graph key,
    with the bytes of the graph's outputs at the size measured (what it is scaled by)."""

    measure: bool  # Options.measure_outside
    measured: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    #: the measurement running from the last forward to its backward
    window: MemoryWindow | None = None

    def scaled(self, key: str, output_bytes: int) -> int:
        """What the step holds outside graph ``key``, scaled from the size it was measured at
        by the bytes of the graph's outputs (a loss computed from them holds a multiple)."""
        measured, measured_output = self.measured.get(key, (0, 0))
        if not measured_output:
            return measured
        return round(measured * output_bytes / measured_output)

    def close(self) -> None:
        """The backward starts (a backward graph, or a region's recomputation before it)."""
        window, self.window = self.window, None
        if window is not None:
            window.close()

    def abandon(self) -> None:
        """The backward never started, or the graphs that ran may not run again."""
        if self.window is not None:
            self.window.abandon()
            self.window = None


@dataclasses.dataclass
class _Levels:
    """What the step held at each part's forward start beyond what the parts before it predict
    (``Plan.held``), by the keys of the graphs the call ran, in order, and its number of parts.

    Why: with graph breaks the model's Python runs between memfit's graphs, and what it keeps
    (tensors eager autograd saves for its own backward, SpecAugment's masks) is under every
    later graph's forward and backward. Measured on tiny HF wav2vec2 under ``"none"``: 49.5 KB
    held by the eager code between the positional convolution and the encoder's layers, and
    the step's peak 2% above the prediction without it. The excess is the model's Python's, not
    the plan's: a graph planned again with the same keys keeps it.
    """

    measure: bool  # Options.measure_outside
    held: dict[tuple[tuple[str, ...], int], tuple[int, ...]] = dataclasses.field(
        default_factory=dict
    )
    #: the marks of the call running (its start, then each graph's forward)
    running: MemoryLevels | None = None

    @staticmethod
    def signature(plan: Plan) -> tuple[tuple[str, ...], int]:
        return tuple(g.key for g in plan.graphs), len(plan.parts())

    def wanted(self, last: Plan | None) -> bool:
        """Whether to measure this call: not yet measured for the graphs the last call ran."""
        if not self.measure:
            return False
        return last is None or (len(last.graphs) > 1 and self.signature(last) not in self.held)

    def applied(self, plan: Plan) -> Plan:
        """``plan`` with what was measured for its graphs, if anything was."""
        held = self.held.get(self.signature(plan))
        if held is None or plan.held == held:
            return plan
        return dataclasses.replace(plan, held=held)

    def abandon(self) -> None:
        if self.running is not None:
            self.running.abandon()
            self.running = None


@dataclasses.dataclass
class _Starts:
    """The start of each graph's backward seen on its first step (``execution.start_watch``),
    and how many times each graph was planned again for it."""

    seen: dict[str, BackwardStart] = dataclasses.field(default_factory=dict)
    replans: dict[str, int] = dataclasses.field(default_factory=dict)

    def saw(self, key: str, seen: BackwardStart, material: bool) -> bool:
        """Remember ``seen`` for graph ``key``; whether to plan again for it now (``material``,
        at most ``START_REPLANS`` times per graph)."""
        self.seen[key] = seen
        if not material or self.replans.get(key, 0) >= START_REPLANS:
            return False
        self.replans[key] = self.replans.get(key, 0) + 1
        return True


@dataclasses.dataclass
class Call:
    """One call in progress: what ``CallSession.start`` opened and ``end`` closes."""

    #: the capture limit is reached: a shape Dynamo has no graph for runs eagerly
    full: bool
    #: the chosen regions installed around the call (``Regions.installed``)
    regions: AbstractContextManager[Any]
    #: the chain of graph runs this call records (None: none)
    chain: StepChain | None
    #: the chain recorded (``StepChain.seal``), once the call ended
    chained: tuple[list[ChainRun], list[ChainValue]] | None = None
    #: the plans the call made (``_Captures.taken``), once it ended
    made: tuple[str, ...] = ()


class CallSession:
    """What a memfit-applied callable goes through on each training call (see the module):
    implements ``BackendEvents`` for the backends it plans with."""

    def __init__(
        self,
        name: str,
        policy: Policy,
        options: Options,
        executor: Executor,
        modules: nn.Module | None = None,
    ) -> None:
        if policy.autotune and executor != INDUCTOR:
            raise ValueError(
                "Options(autotune=True) times plans as Inductor compiles them: use "
                "executor='inductor'"
            )
        #: the one place this session's warnings are given, each once
        self.warnings = CallWarnings()
        if executor == INDUCTOR and policy.budget is not None and policy.offload:
            self.warnings.give(Once.INDUCTOR_BUDGET, INDUCTOR_BUDGET_WARNING)
        self.name = name
        #: what every graph is planned and run by; the one object holding the policy
        self.settings = BackendSettings(
            policy,
            executor=executor,
            attention=str(options.attention),
            loss_head=str(options.loss_head),
            offloader=Offloader(options) if policy.offload else None,
            step_budget=StepBudget() if policy.budget is not None else None,
        )
        self.captures = _Captures(options.max_shapes)
        self.outside = _Outside(options.measure_outside)
        self.levels = _Levels(options.measure_outside)
        self.starts = _Starts()
        self.step = StepShares()
        self.chain = ChainState()
        self.watcher = GraphBreakWatcher(name)
        #: the planned graphs the current call ran, in order (a region's call notes its own)
        self.ran: list[GraphPlan] = []
        #: submodules with graph breaks, recomputed whole (a wrapped model only); whether the
        #: last call changed them (they apply from the next call)
        self.regions = (
            Regions(modules, self.ran, self.outside.close) if modules is not None else None
        )
        self.regions_changed = False
        #: the chain the current call records (None: none, or no call running)
        self.recording: StepChain | None = None
        self.last_plan: Plan | None = None
        self.unplanned: str | None = None  # why the last training call ran without a plan
        #: the next call captures and plans again
        self.replan = False
        #: a graph of the last capture was compiled inside a CPU profiler session, so its peaks
        #: are Inductor's schedule's, not measured: plan again on a call outside one
        self.measure_later = False

    @property
    def policy(self) -> Policy:
        """The policy the calls are planned with (``settings.policy``)."""
        return self.settings.policy

    # -- BackendEvents: what the backends report and ask (``execution.events``) --------------

    def compiling(self) -> None:
        if self.regions is not None:
            self.regions.compiling()

    def plan_made(self, graph: GraphPlan) -> None:
        self.captures.made.append(graph)

    def graph_ran(self, graph: GraphPlan) -> None:
        self.ran.append(graph)
        if self.levels.running is not None:
            self.levels.running.mark()
        if self.recording is not None:
            self.recording.reported(graph)
        if self.regions is not None:
            self.regions.graph_ran()

    def budget_missed(self, graph: GraphPlan) -> None:
        self.replan = True
        if self.warnings.due(Once.BUDGET_MISSED):
            self.warnings.give(Once.BUDGET_MISSED, budget_missed(self.name, graph))

    def backward_started(self, graph: GraphPlan) -> None:
        self.outside.close()

    def backward_start_seen(self, key: str, seen: BackwardStart, material: bool) -> None:
        """Graph ``key``'s first backward started otherwise than its plan assumed: plan it with
        what was seen from the next call where that moves its peak materially, else from its
        next plan made for another reason."""
        if self.starts.saw(key, seen, material):
            self.replan = True

    def unmeasured(self) -> None:
        """Why plan again: a plan's peaks under Inductor are measured once compiled; without
        that they are Inductor's schedule's estimate, and nothing else would ever replace it.
        Measured on the zoo's U-Net under ``"memory"``, first called inside ``memfit.measure``:
        every later step peaked at 1.37 MiB against 1.01 predicted (``docs/measurements.md``),
        and a budget checked against the estimate is not guaranteed."""
        self.measure_later = True

    def outside_bytes(self, key: str, output_bytes: int) -> int:
        return self.outside.scaled(key, output_bytes)

    def backward_start(self, key: str) -> BackwardStart | None:
        return self.starts.seen.get(key)

    def share(self, sized_key: str) -> GraphShare | None:
        return self.step.shares.get(sized_key)

    def chain_mode(self) -> tuple[bool, int | None] | None:
        return self.chain.mode(self.chains())

    # -- the call -------------------------------------------------------------------------

    def chains(self) -> bool:
        """Whether this call's graph runs form a chain (``execution.run_chain.chains``), and not
        where regions recompute submodules whole (their graphs run again as Python, which a
        chain cannot replay)."""
        return chains(self.policy, self.settings.executor) and (
            self.regions is None or not self.regions.chosen
        )

    @property
    def replan_pending(self) -> bool:
        """Whether the next call captures and plans again, or the next call outside a CPU
        profiler session does."""
        return self.replan or self.measure_later

    def replans_now(self) -> bool:
        """Before a call: whether it captures and plans again (the caller makes a new backend);
        a replan waits while the capture limit is reached."""
        self.outside.abandon()  # the last call's backward never started
        MemoryWindow.settle()  # before anything compiles: measured outside, delivered now
        if self.measure_later and cpu_recording_blocked() is None:
            self.measure_later = False
            self.replan = True
        if self.replan and not self.captures.full:
            self.replan = False
            return True
        return False

    def start(self, device: torch.device | None = None) -> Call:
        """A call starts: what it spends and runs counted from zero, its regions and chain;
        where it is measured, the levels at its graphs' starts (``device``: its inputs')."""
        full = self.captures.full
        settings = self.settings
        if settings.step_budget is not None:
            settings.step_budget.spent = 0
        if settings.offloader is not None:
            settings.offloader.spent = 0
        self.captures.made.clear()
        self.ran.clear()
        regions = self.regions.installed() if self.regions else contextlib.nullcontext()
        # A chain needs two graph runs: after a call that ran one, none is recorded (a call that
        # runs more from then on is one unplanned by the chain, and the next is).
        several = self.last_plan is None or len(self.last_plan.graphs) > 1
        chain = self.recording = StepChain(self.chain.rule) if several and self.chains() else None
        self.chain.next = None
        self.levels.abandon()
        if device is not None and self.levels.wanted(self.last_plan):
            self.levels.running = MemoryLevels.open(device, self._measured_levels)
        return Call(full, regions, chain)

    def end(self, call: Call) -> None:
        """The compiled target returned or raised: the chain sealed, the plans made taken."""
        if call.chain is not None:
            call.chained = call.chain.seal()
            self.recording = None
        call.made = self.captures.taken()

    def finish(self, call: Call, out: Any, report: GraphBreakReport) -> None:
        """After a call that returned ``out``: the plan it ran, what it changes for the next
        call, and what is said about it."""
        self.captures.count(call.made)
        # Regions found in this call change the step from the next call on: check it then.
        self.regions_changed = self.regions is not None and self.regions.decide(self.policy)
        if self.ran:
            self._ran_planned(call, out)
            # A call that captured allocated for its capture too: measured on a settled one.
            if self.levels.running is not None and not call.made and _starts_training(out):
                self.levels.running.close()
            self.levels.abandon()
        elif _starts_training(out):
            self._ran_unplanned(call.full, report)
        if report.broke:
            report.warn_once(break_action(self.regions, self.policy, self.chains()))

    def _ran_planned(self, call: Call, out: Any) -> None:
        """A call ran memfit's graphs: its plan, its chain, what it held outside, its budget."""
        ran, last, made = self.ran, self.last_plan, call.made
        calls = tuple(self.regions.calls) if self.regions is not None else ()
        # The same graphs as the last call: the same Plan object (callers compare plans).
        if (
            last is None
            or len(last.graphs) != len(ran)
            or any(a is not b for a, b in zip(last.graphs, ran))
            or last.regions != calls
        ):
            self.last_plan = self.levels.applied(
                Plan(policy=self.policy.name, graphs=tuple(ran), regions=calls)
            )
        if call.chained is not None and _starts_training(out):
            self._after_chain(*call.chained, settled=not made)
        self.unplanned = None
        if (
            self.outside.measure
            and ran[-1].key not in self.outside.measured
            and MemoryWindow.can_open(record=self._records_outside())
            and _starts_training(out)
        ):
            self._open_window(out)
        budget = self.policy.budget is not None and not self.regions_changed
        if made and budget and self.last_plan is not None and _starts_training(out):
            self._check_step(self.last_plan)
        if made and self.last_plan is not None:
            self._say_what_cannot_act(self.last_plan, out)

    def _after_chain(
        self, runs: list[ChainRun], values: list[ChainValue], *, settled: bool
    ) -> None:
        """The chain of the call that just ran (``settled``: it captured nothing): the rule
        the next call runs by, the plan's chain, and a budget the chain cannot hold refused."""
        plan = self.last_plan
        if plan is None:
            return
        outcome = self.chain.after_call(runs, values, plan, settled, self.policy)
        if outcome.replan:
            self.replan = True
        if outcome.shown is not None and plan.chain != outcome.shown:
            self.last_plan = dataclasses.replace(plan, chain=outcome.shown)
        if outcome.refuse is not None:
            assert self.chain.budget is not None
            self._fail()
            raise refused_step(self.name, plan, self.chain.budget, outcome.refuse)

    def _measured_levels(self, levels: list[int]) -> None:
        """The bytes live at the call's start and at each of its graphs' forward starts: what
        the step held beyond the plan that ran, kept for its graphs (``_Levels``)."""
        plan = self.last_plan
        if plan is None or len(levels) != len(plan.graphs) + 1:
            return
        measured = plan.with_levels(levels[1:])
        if not measured.held:
            return
        self.levels.held[_Levels.signature(plan)] = measured.held
        if plan.chain is None:
            self.last_plan = measured

    def _say_what_cannot_act(self, plan: Plan, out: Any) -> None:
        """Once each, after a call that planned: a policy that could not act here, and a budget
        that cannot cover what the caller's code holds.

        Why: measured on CPU (2 threads, no copy overlaps compute), ``"swap"`` offloaded nothing
        on a MobileNet-like net and peaked at plain's 1.00x without a word; and a tied-weight
        GRU LM with its cross-entropy outside the module peaked at 1.44x its ``budget=`` from
        the second step on, with no warning, because on CPU memfit could measure what the caller
        holds between forward and backward only inside ``memfit.measure``; it now measures it
        on its own too, except under another profiler, where this warning stays."""
        said = swap_saved_little(self.name, plan.offloaded_bytes, plan.kept_bytes)
        if self.policy.swaps and said is not None:
            self.warnings.give(Once.SWAP_LITTLE, said)
        if (
            self.policy.budget is not None
            and self.outside.measure
            and self.warnings.due(Once.LOSS_OUTSIDE_UNSEEN)
            and not any(g.outside_bytes for g in plan.graphs)
            and not plan.graphs[-1].returns_loss
            and _output_device(out) == "cpu"
            and not MemoryWindow.can_open()
            and _starts_training(out)
        ):
            said = loss_outside_unseen(self.name, plan.graphs[-1].output_bytes)
            self.warnings.give(Once.LOSS_OUTSIDE_UNSEEN, said)

    def _open_window(self, out: Any) -> None:
        """Measure what the caller's code holds between this forward and its backward."""
        leaves, _ = tree_flatten(out)
        device = next((t.device for t in leaves if isinstance(t, torch.Tensor)), None)
        plan = self.last_plan
        if device is None or plan is None:
            return
        self.outside.window = MemoryWindow.open(
            device,
            lambda peak: self._measured_outside(plan, peak),
            record=self._records_outside(),
            watch=[t for t in leaves if isinstance(t, torch.Tensor)],
        )

    def _records_outside(self) -> bool:
        """Whether a window may start a CPU recording of its own: where a budget must cover
        what the caller's code holds (a loss outside the model). Why: a budget on CPU with the
        loss outside peaked 1.12-1.44x over it (a tied-weight GRU LM at 0.5x plain, a small
        Llama at 0.25x) while memfit could measure it only inside a ``memfit.measure``; without
        a budget nothing is refused by it, and no profiler runs in a user's step."""
        return self.policy.budget is not None

    def _measured_outside(self, plan: Plan, outside: int) -> None:
        """The step held ``outside`` bytes between ``plan``'s forward and backward: remember it
        for the graph, and plan again if that peak is above what the plan allowed for."""
        last = plan.graphs[-1]
        self.outside.measured[last.key] = (outside, last.output_bytes)
        step_peak = plan.forward_end_bytes + outside
        if step_peak <= 1.01 * plan.predicted_peak_bytes:
            return
        self.replan = True
        if self.warnings.due(Once.HELD_OUTSIDE):
            said = held_outside(self.name, outside, step_peak, plan.predicted_peak_bytes)
            self.warnings.give(Once.HELD_OUTSIDE, said)

    def _check_step(self, plan: Plan) -> None:
        """After a call that planned graphs: does the step fit its budget as a whole
        (``execution.step_check``)? BudgetError now if no plan can."""
        assert self.policy.budget is not None
        verdict = self.step.check(self.name, plan, self.policy.budget, self.chain)
        if verdict.replan:
            self.replan = True
        if verdict.error is not None:
            self._fail()
            raise verdict.error
        if verdict.over is not None:
            said = step_over_budget(
                self.name, len(plan.graphs), verdict.over, plan.predicted_peak_bytes
            )
            self.warnings.give(Once.STEP_OVER_BUDGET, said)

    def _fail(self) -> None:
        """The graphs just compiled were planned over budget: none of them may run again."""
        self.replan = True
        self.outside.abandon()

    def _ran_unplanned(self, full: bool, report: GraphBreakReport) -> None:
        """A training call ran none of memfit's graphs: say so, and keep no stale plan."""
        why = unplanned(self.name, full, len(self.captures.shapes), self.captures.limit, report)
        if report.frame_skipped:
            self.watcher.warned = True  # the one warning says both: the break, and the skip
        self.last_plan = None
        self.unplanned = why
        self.warnings.give(Once.UNPLANNED, why)


class InRegion:
    """The events of the graphs inside a region (``execution.regions``), planned with ``"none"``
    by a backend of their own: reported to the session as any graph's, but each planned alone
    (no share of a step, no chain, no budget to miss: what they keep lives only while their
    region is recomputed)."""

    def __init__(self, session: CallSession) -> None:
        self._session = session

    def compiling(self) -> None:
        self._session.compiling()

    def plan_made(self, graph: GraphPlan) -> None:
        self._session.plan_made(graph)

    def graph_ran(self, graph: GraphPlan) -> None:
        self._session.graph_ran(graph)

    def budget_missed(self, graph: GraphPlan) -> None:
        return None

    def backward_started(self, graph: GraphPlan) -> None:
        self._session.backward_started(graph)

    def backward_start_seen(self, key: str, seen: BackwardStart, material: bool) -> None:
        self._session.backward_start_seen(key, seen, material)

    def unmeasured(self) -> None:
        self._session.unmeasured()

    def outside_bytes(self, key: str, output_bytes: int) -> int:
        return self._session.outside_bytes(key, output_bytes)

    def backward_start(self, key: str) -> BackwardStart | None:
        return self._session.backward_start(key)

    def share(self, sized_key: str) -> GraphShare | None:
        return None

    def chain_mode(self) -> tuple[bool, int | None] | None:
        return None
