"""One runner for training-step benchmarks: the first step, the exact peak, interleaved timing.

Why one: the depth sweep, the budget frontier and the CLI's ``demo`` and ``profile`` all compare
ways of running the same training step, and a comparison is only fair if every way is measured
alike. The protocol, for each :class:`Method` (a named way to run one step of a model):

1. **first step** (:func:`first_step`): for memfit or ``torch.compile`` this is capture,
   planning and compilation; timed as ``first_step_s`` (the device synchronised around it);
2. **peak** (:func:`measure_peak`): one step under ``memfit.measure``, exact allocator
   accounting on CPU and deterministic, so one run is enough;
3. **time** (:func:`time_interleaved`): ``rounds`` rounds of one turn per method, each step
   under ``memfit.measure(..., profile_memory=False)`` (the memory profiler inflates CPU time),
   the starting method rotated each round (:func:`rotation`) so a busy machine's slow moments
   fall on every method alike. ``memfit.measure`` collects garbage before each step, outside the
   timed span, and automatic collection is off during a round, so none lands inside a step.
   The objects alive when timing starts are frozen (``gc.freeze``) until it ends, so that
   collection scans only what the steps made: over a heap holding several compiled programs
   a full collection is not cheap (0.23 s with four of the frontier's ResNet points compiled,
   on a 2-core CPU where their steps take 0.1 s). Before the freeze the CPU frontier's ResNet
   took 690 s to time 660 steps (102 s of steps), after it 248 s for 1840 (164 s); on an H100
   the transformer's took 90 s to time its nine points' 16 steps of 10 ms each.
   A turn is ``settle`` untimed steps, then ``steps`` timed ones: a training loop runs one
   method step after step, and its first step after another method's runs on the memory that
   method left. On CPU that is not a small effect: glibc hands freed memory back to the kernel
   by its own thresholds, and a step then takes a page fault for every page it touches anew.
   Measured on the budget frontier's ResNet (2 CPU threads, torch 2.13): one step per turn,
   plain eager took 10-13 thousand minor page faults per step, ``torch.compile`` 4-7 thousand
   and memfit 1.5-2 thousand, depending on which method ran before; after one settling step,
   plans peaking under 48 MiB took none and those above 59 MiB 1.7-3.3 thousand, every step.
   The minor page faults of each timed step (with the collection before it) are recorded
   beside its time (``faults``).

Every step starts with the gradients set to ``None``, as ``optimizer.zero_grad()`` does, so each
step allocates its gradients as a real one does. A method that raises is recorded in its
``record`` (``memfit.bench.failure.record_failure``) and skipped from then on, so one failure
never ends a sweep; the CLI, which stops at the first error, has it raised instead
(``record_failures=False``). :class:`Snapshot` catches recompilation during measurement: a change
in Dynamo's graph count, or a memfit wrapper that planned again.
"""

from __future__ import annotations

import gc
import resource
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn

import memfit
from memfit._compat import unique_graph_count
from memfit.bench.failure import record_failure
from memfit.measurement.timing import synchronize
from memfit.planning.plan import Plan

__all__ = [
    "Method",
    "Snapshot",
    "attempt",
    "first_step",
    "measure_peak",
    "measure_peaks",
    "plan_record",
    "rotation",
    "time_interleaved",
    "warm_up",
]

#: The phases a failure is recorded under (``record["error_phase"]``).
FIRST_STEP = "compiling (first step)"
PEAK = "measuring memory"
TIMING = "timing"


class Method:
    """A named way to run one training step of a model, and what was measured of it.

    ``model`` is the plain model whose parameters the step trains (its gradients are reset before
    every step); ``step`` runs forward, loss and backward once; ``module`` is what runs it, the
    model or a wrapper of it (a ``memfit.CheckpointedModule``'s plan is watched by
    :class:`Snapshot`). ``record`` collects the results, step times under ``"times_s"``.
    """

    def __init__(
        self,
        name: str,
        model: nn.Module,
        step: Callable[[], object],
        module: nn.Module | None = None,
        record: dict[str, Any] | None = None,
        record_failures: bool = True,
    ) -> None:
        self.name = name
        self.model = model
        self.step = step
        self.module = model if module is None else module
        self.record: dict[str, Any] = {} if record is None else record
        self.record.setdefault("times_s", [])
        self.record.setdefault("faults", [])
        self.record.setdefault("turns_s", [])
        #: On an exception: record it and skip this method from then on (a benchmark sweep), or
        #: raise it (the CLI).
        self.record_failures = record_failures
        self.failed = False

    def __repr__(self) -> str:
        return f"Method({self.name!r}{', failed' if self.failed else ''})"

    @property
    def times(self) -> list[float]:
        """Seconds of each timed step, in the order they ran."""
        return self.record["times_s"]

    @property
    def faults(self) -> list[int]:
        """The process's minor page faults during each timed step (and the garbage collection
        ``memfit.measure`` runs before it), in the order they ran."""
        return self.record["faults"]

    def zero_grad(self) -> None:
        """Set the model's gradients to ``None``, as ``optimizer.zero_grad()`` does."""
        self.model.zero_grad(set_to_none=True)

    def run_step(self) -> None:
        """One untimed step, gradients reset first (a warm-up step)."""
        self.zero_grad()
        self.step()

    def fail(self, phase: str, err: BaseException) -> None:
        """Record ``err``, raised while ``phase``; the method is skipped from now on.

        Called inside the ``except`` block, so the traceback recorded is ``err``'s.
        """
        self.failed = True
        record_failure(self.record, self.name, phase, err)


def attempt(method: Method, phase: str, action: Callable[[], object]) -> bool:
    """Run ``action`` for ``method``: True if it returned, False if it raised and was recorded.

    An exception is recorded with ``phase`` (:meth:`Method.fail`), or re-raised unchanged when
    ``method.record_failures`` is False.
    """
    try:
        action()
    except Exception as err:  # noqa: BLE001 - recorded and reported, the sweep goes on
        if not method.record_failures:
            raise
        method.fail(phase, err)
        return False
    return True


#: Steps ``_settle`` runs at most: two planned again for the backward's start, one measured, one
#: planned again for what it measured outside the graphs.
SETTLE_STEPS = 4


def first_step(method: Method, device: torch.device | None = None) -> float:
    """Run ``method``'s first step and record its seconds as ``first_step_s``; raises on error."""
    method.zero_grad()
    synchronize(device)
    t0 = time.perf_counter()
    method.step()
    synchronize(device)
    seconds = time.perf_counter() - t0
    method.record["first_step_s"] = seconds
    _settle(method, device)
    return seconds


def _settle(method: Method, device: torch.device | None) -> None:
    """Let a model memfit is applied to plan again with what its first steps showed, before
    anything is measured or timed: which outputs the loop holds through the backward
    (``execution.start_watch``), and what the step holds outside its graphs (a loss outside
    the model), which on CPU memfit measures only inside ``memfit.measure``. Each plan made again
    is captured on the next call. None of these steps is counted in ``first_step_s``.
    """
    module = method.module
    if isinstance(module, memfit.CheckpointedModule):
        state: Any = module.memfit
    elif hasattr(module, "replan_pending"):  # a memfit.step
        state = module
    else:
        return
    measured = False
    for _ in range(SETTLE_STEPS):
        if state.replan_pending:
            method.zero_grad()
            method.step()
            synchronize(device)
        elif not measured:
            method.zero_grad()
            memfit.measure(method.step, device=device)
            measured = True
        else:
            return


def plan_record(plan: Plan) -> dict[str, Any]:
    """What a benchmark records of the plan a memfit wrapper made on its first step; each
    graph's note says how its plan was chosen (under Inductor: measured, timed)."""
    return {
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "baseline_peak_bytes": plan.baseline_peak_bytes,
        "kept_bytes": plan.kept_bytes,
        "recompute_flops": int(plan.recompute_flops),
        "forward_flops": int(plan.forward_flops),
        "graphs": len(plan.graphs),
        "notes": [g.note for g in plan.graphs],
    }


def warm_up(method: Method, device: torch.device | None = None) -> bool:
    """The first step, and for a memfit wrapper what its plan decided; False if it failed."""

    def run() -> None:
        first_step(method, device)
        if isinstance(method.module, memfit.CheckpointedModule):
            method.record.update(plan_record(method.module.memfit.plan))

    return attempt(method, FIRST_STEP, run)


def measure_peak(
    method: Method, device: torch.device | None = None, step: Callable[[], object] | None = None
) -> memfit.Measurement[Any]:
    """One step under ``memfit.measure``: records ``peak_bytes``, ``end_bytes`` and
    ``profiled_time_s`` and returns the measurement (timeline included); raises on error.

    ``step`` replaces ``method.step`` for this run: the same step, instrumented (the CLI marks
    where the forward ends).
    """
    method.zero_grad()
    m = memfit.measure(method.step if step is None else step, device=device)
    method.record["peak_bytes"] = m.peak_bytes
    method.record["end_bytes"] = m.end_bytes
    method.record["profiled_time_s"] = m.time_s
    return m


def measure_peaks(methods: Sequence[Method], device: torch.device | None = None) -> None:
    """:func:`measure_peak` for every method not failed so far, recording failures."""
    for method in methods:
        if not method.failed:
            attempt(method, PEAK, partial(measure_peak, method, device))


def rotation(count: int, rounds: int) -> list[list[int]]:
    """The order of each timing round over ``count`` methods: round r starts at r mod count.

    >>> rotation(3, 4)
    [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]
    """
    return [[(r + i) % count for i in range(count)] for r in range(rounds)]


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _time_turn(method: Method, device: torch.device | None, settle: int, steps: int) -> None:
    start = time.perf_counter()
    for _ in range(settle):  # untimed: no collection before it (``measure`` collects once)
        method.run_step()
    for _ in range(steps):
        method.zero_grad()
        before = _minor_faults()
        seconds = memfit.measure(method.step, device=device, profile_memory=False).time_s
        method.faults.append(_minor_faults() - before)
        method.times.append(seconds)
    method.record["turns_s"].append(time.perf_counter() - start)


def time_interleaved(
    methods: Sequence[Method],
    rounds: int,
    device: torch.device | None = None,
    before_step: Callable[[Method, int], object] | None = None,
    *,
    settle: int = 0,
    steps: int = 1,
) -> dict[str, Any]:
    """``rounds`` turns of every method not failed so far, interleaved (see the module): each
    turn ``settle`` untimed steps, then ``steps`` timed ones.

    Appends to each method's ``times_s``, ``faults`` and ``turns_s`` (each whole turn's
    seconds: its settling steps and collections too); a method that fails is recorded and not
    timed again. ``before_step(method, round)`` is called before each turn (progress reporting).

    Returns what the time outside the steps depends on: ``frozen_objects``, the objects frozen
    when the timing began, ``frozen_before``, those someone else had frozen before it (see
    :func:`_frozen_heap`), and ``collect_s``, the seconds of one collection then, as each timed
    step's takes. (On an H100 the frontier's transformer took over 170 s to time what its steps
    ran in about 9.)
    """
    if settle < 0 or steps < 1:
        raise ValueError(f"need settle >= 0 and steps >= 1, got settle={settle}, steps={steps}")
    live = [m for m in methods if not m.failed]
    with _frozen_heap() as (before, frozen):
        start = time.perf_counter()
        gc.collect()
        heap = {
            "frozen_objects": frozen,
            "frozen_before": before,
            "collect_s": time.perf_counter() - start,
        }
        for rnd, order in enumerate(rotation(len(live), rounds)):
            gc_was_enabled = gc.isenabled()
            gc.disable()
            try:
                for i in order:
                    method = live[i]
                    if method.failed:
                        continue
                    if before_step is not None:
                        before_step(method, rnd)
                    attempt(method, TIMING, partial(_time_turn, method, device, settle, steps))
            finally:
                if gc_was_enabled:
                    gc.enable()
    return heap


@contextmanager
def _frozen_heap() -> Iterator[tuple[int, int]]:
    """The objects alive now left out of every collection until the block ends (see the
    module); yields how many were frozen before (by someone else) and how many are now.

    A heap someone else froze is frozen again, the objects made since added to it, and left
    frozen afterwards: unfreezing would thaw theirs too. Skipping the freeze instead cost the
    H200 of 2026-11-27, where something in the process had frozen the heap early, 0.58 s of
    collection before every timed step of 10 ms (docs/measurements.md, "On GPUs").
    """
    before = gc.get_freeze_count()
    gc.collect()
    gc.freeze()
    try:
        yield before, gc.get_freeze_count()
    finally:
        if not before:
            gc.unfreeze()


class Snapshot:
    """Dynamo's graph count and every memfit wrapper's plan, taken before measuring.

    Compared afterwards, a change means something was compiled or planned again while it was
    being measured, so its numbers include that work.
    """

    def __init__(self, methods: Sequence[Method]) -> None:
        self.graphs = unique_graph_count()
        #: The plan of each memfit wrapper among ``methods`` (not failed) at the snapshot.
        self.plans: dict[Method, Plan] = {
            m: m.module.memfit.plan
            for m in methods
            if not m.failed and isinstance(m.module, memfit.CheckpointedModule)
        }

    def graphs_compiled(self) -> int:
        """Graphs Dynamo compiled since the snapshot."""
        return unique_graph_count() - self.graphs

    def plan_changed(self, method: Method) -> bool | None:
        """Whether ``method``'s wrapper planned again since the snapshot; None if it is none."""
        plan = self.plans.get(method)
        if plan is None or not isinstance(method.module, memfit.CheckpointedModule):
            return None
        return method.module.memfit.plan is not plan
