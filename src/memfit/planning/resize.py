"""A plan chosen at one size of a graph with symbolic sizes, at the other sizes it runs at.

NOTE [One capture for many sizes]
    Capturing and planning a model takes seconds (Dynamo's trace, AOTAutograd's joint trace,
    op scratch, the planner; about 8 s for a 12-layer GPT-2 on two cores) against a training
    step of a fraction of that, so capturing every new sequence length again made variable-length
    training several times slower than eager PyTorch. When a size varies between calls, Dynamo
    captures the model once with that dimension as a symbol, and memfit plans that one graph:
    its decisions (what to keep, what to recompute) are chosen at the sizes of the call captured
    and then used for every size in a range, with no new capture, because the graphs that run
    are built from the decisions alone and are valid at every size.

    What does depend on the size is every number about the plan, and whether it is still the
    plan the policy asked for. So:

    * at each size that runs, ``plan_at`` replays the same decisions in the simulator with every
      byte count at that size (milliseconds), and that is the plan the wrapper reports: its
      predicted peak is for the call that ran;
    * before the graph is used, ``size_range`` tries the decisions at 2, 4, 8, ... 64 times the
      captured sizes and at 1/2, 1/4, ... of them (bisecting between the last factor that held
      and the first that did not), and keeps the range where they still do what
      the policy promises (``holds``): a byte budget's peak within the budget (down to half the
      captured sizes only: a byte budget holds at every smaller size, but below half of it a
      plan recomputing less would fit, so such a size is captured again), a fraction's
      peak within it or the plan keeping at most that fraction of the activations, ``"memory"``
      saving as large a share of plain autograd's peak as where it was chosen (within 5 points)
      or, where that share moved, peaking within 5% of what the planner finds at those sizes
      (one planner run on the same graph, about a second for a 12-layer GPT-2, against a
      capture's ten), and never a peak above plain autograd's for the policies that promise
      it. The range becomes guards of the capture, so a size outside it is captured and planned
      again, with a range of its own.

    Peaks grow with sizes, so a byte budget that holds at the largest size of a range holds
    within it; the other tests are checked at the points tried only. Every symbol is scaled by
    the same factor, so with several symbols (batch and length) the range is a box whose
    diagonal was tried. Op scratch memory is measured at the captured sizes and scaled by the
    bytes each op touches (``JointGraph.scale_scratch``).

    With ``executor="inductor"`` the plan at the captured sizes is predicted from its compiled
    graphs, run once (``execution.inductor_fit``), and the simulation does not describe what
    Inductor runs (its fused kernels hold fewer buffers: an MLP's simulation was 1.16-1.22x what it
    measured at every size). What the compiled graphs held beyond the simulation at the captured
    sizes (``CompiledOffset``) is carried to the other sizes in proportion to the simulated peak
    less the parameters' gradients: the difference is in what grows with the sizes (fused or
    dropped intermediates, kernels' scratch), while gradients are simulated exactly at every
    size. Measured on an MLP and a ResNet with a symbolic batch: 1.00 of the measured step at
    every size, against 1.16-1.26x from the simulation alone.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from memfit.analysis.graph import JointGraph
from memfit.analysis.simulate import simulate_step
from memfit.analysis.sizes import Sizes
from memfit.planning.decision import Decision
from memfit.planning.keep_rules import keep_all
from memfit.planning.plan import GraphPlan
from memfit.planning.planner import describe_plan, plan_graph, with_executor_peaks
from memfit.planning.policy import Policy

__all__ = [
    "CompiledOffset",
    "plan_at",
    "holds",
    "size_range",
    "RANGE_FACTORS",
    "BISECTIONS",
    "MEMORY_SLACK",
]

#: Factors of the captured sizes a plan is tried at, upwards (and their inverses, downwards).
RANGE_FACTORS = (2, 4, 8, 16, 32, 64)

#: Bisections between the last factor that held and the first that did not (3: within 9%).
BISECTIONS = 3

#: ``"memory"`` keeps its decisions while its peak, as a share of plain autograd's at the same
#: size, is at most this much above its share where the decisions were chosen, or at most this
#: fraction above the least peak the planner finds at that size.
MEMORY_SLACK = 0.05

_PASSED = (Decision.KEEP, Decision.OFFLOAD)


@dataclasses.dataclass(frozen=True)
class CompiledOffset:
    """What a plan's compiled graphs held at the captured sizes beyond its simulation there
    (negative: less), and the simulated peak less parameters' gradients there, which scales it
    to other sizes."""

    forward_peak_bytes: int
    backward_peak_bytes: int
    forward_end_bytes: int
    varying_bytes: int

    @classmethod
    def between(cls, compiled: GraphPlan, simulated: GraphPlan) -> CompiledOffset:
        """``compiled`` (predicted from the executor's peaks) less ``simulated`` (the same
        decisions at the same sizes, simulated)."""
        return cls(
            compiled.forward_peak_bytes - simulated.forward_peak_bytes,
            compiled.backward_peak_bytes - simulated.backward_peak_bytes,
            compiled.forward_end_bytes - simulated.forward_end_bytes,
            _varying_bytes(simulated),
        )

    def applied(self, simulated: GraphPlan) -> GraphPlan:
        """``simulated`` (at other sizes) with the offset scaled as its peak less gradients."""
        scale = _varying_bytes(simulated) / self.varying_bytes if self.varying_bytes else 1

        def moved(simulated_bytes: int, offset: int) -> int:
            return max(0, simulated_bytes + round(offset * scale))

        return with_executor_peaks(
            simulated,
            moved(simulated.forward_peak_bytes, self.forward_peak_bytes),
            moved(simulated.backward_peak_bytes, self.backward_peak_bytes),
            forward_end=moved(simulated.forward_end_bytes, self.forward_end_bytes),
            source="the simulation at these sizes plus what the compiled graphs held beyond it "
            "at the captured sizes, scaled with the simulated peak less gradients",
        )


def _varying_bytes(plan: GraphPlan) -> int:
    """The part of ``plan``'s simulated peak that is not parameters' gradients."""
    return max(0, plan.predicted_peak_bytes - plan.parameter_grad_bytes)


def plan_at(
    jg: JointGraph,
    plan: GraphPlan,
    policy: Policy,
    sizes: Sizes,
    *,
    outside: Callable[[int], int] | None = None,
    offset: CompiledOffset | None = None,
) -> GraphPlan:
    """``plan``'s decisions on ``jg`` (the graph they were chosen on) with its sizes at
    ``sizes``: the same kept and recomputed values, every number simulated at these sizes, and
    the peaks moved by ``offset`` where the graphs run compiled (``CompiledOffset``).

    ``outside(output_bytes)`` is what the step holds outside the graph between forward and
    backward when the graph's outputs take ``output_bytes`` (a loss computed from them). For a
    budget plan, ``budget_bytes`` is the budget at these sizes (a fraction resolves against
    plain autograd at them).
    """
    at = jg.at(sizes)
    at.outside_bytes = outside(at.bytes_of(at.fwd_outputs)) if outside is not None else 0
    kept = {n for n in at.nodes if plan.decisions.get(n.name) in _PASSED}
    sim = simulate_step(at, kept)
    baseline = keep_all(at)
    base_sim = simulate_step(at, baseline)
    described = describe_plan(
        at,
        policy,
        kept,
        sim,
        base_sim,
        baseline,
        note=plan.note,
        budget_bytes=None,
        frontier=plan.frontier,
    )
    described = dataclasses.replace(
        described,
        decisions=plan.decisions,  # the same decisions: shared, not one dict per size
        kept=plan.kept,
        recomputed=plan.recomputed,
        attention=plan.attention,
        loss_heads=plan.loss_heads,
        key=plan.key,
        sizes=sizes.key,
        planned_sizes=plan.planned_sizes,
        size_range=plan.size_range,
    )
    if offset is not None:
        described = offset.applied(described)
    if policy.budget is not None:
        described = dataclasses.replace(described, budget_bytes=_budget_at(described, policy))
    return described


def _budget_at(plan: GraphPlan, policy: Policy) -> int:
    """The budget, in bytes, at the sizes ``plan`` was simulated at."""
    budget = policy.budget
    assert budget is not None
    resolved = budget.resolve(plan.baseline_peak_bytes, plan.baseline_kept_bytes)
    if budget.fraction is not None and plan.keeps_fraction(budget.fraction):
        # As the planner reads a fraction: met by a plan keeping at most that share of the
        # activations, even where recomputing needs more than plain autograd's peak less the rest.
        return max(resolved, plan.predicted_peak_bytes)
    return resolved


def holds(planned: GraphPlan, at: GraphPlan, policy: Policy, *, spent_bytes: int = 0) -> bool:
    """Whether ``at`` (``planned``'s decisions at other sizes, from ``plan_at``) still does what
    ``policy`` promises: see NOTE [One capture for many sizes]. ``spent_bytes`` is what earlier
    graphs of the step keep, taken off a byte budget."""
    if policy.never_worse_than_none and at.predicted_peak_bytes > at.baseline_peak_bytes:
        return False
    if policy.budget is not None:
        assert policy.budget is not None and at.budget_bytes is not None
        limit = at.budget_bytes - (spent_bytes if policy.budget.fraction is None else 0)
        return at.predicted_peak_bytes <= limit
    if policy.least_memory and planned.baseline_peak_bytes and at.baseline_peak_bytes:
        share = planned.predicted_peak_bytes / planned.baseline_peak_bytes
        return at.predicted_peak_bytes / at.baseline_peak_bytes <= share + MEMORY_SLACK
    return True


def _narrow(ok: Callable[[float], bool], good: float, bad: float) -> float:
    """The factor between ``good`` (holds) and ``bad`` (does not) where holding ends, to within
    ``2 ** (1 / 2 ** BISECTIONS)`` (geometric bisection)."""
    for _ in range(BISECTIONS):
        middle = math.sqrt(good * bad)
        if ok(middle):
            good = middle
        else:
            bad = middle
    return good


def size_range(
    jg: JointGraph,
    plan: GraphPlan,
    policy: Policy,
    hints: Sizes,
    *,
    outside: Callable[[int], int] | None = None,
    offset: CompiledOffset | None = None,
) -> dict[Any, tuple[int | None, int | None]]:
    """For each size symbol, the least and greatest value ``plan``'s decisions are used for
    (None: no bound), tried at ``RANGE_FACTORS`` of the captured sizes ``hints`` (``outside``
    and ``offset`` as for ``plan_at``)."""

    def ok(factor: float) -> bool:
        sizes = hints.scaled(factor)
        at = plan_at(jg, plan, policy, sizes, outside=outside, offset=offset)
        if holds(plan, at, policy):
            return True
        if not policy.least_memory or at.predicted_peak_bytes > at.baseline_peak_bytes:
            return False
        # Its share of plain autograd's peak moved (fixed costs such as the gradients weigh
        # more at small sizes): still "memory" if no plan made at these sizes is much lower.
        there = jg.at(sizes)
        there.outside_bytes = outside(there.bytes_of(there.fwd_outputs)) if outside else 0
        best = plan_graph(there, policy).predicted_peak_bytes
        return at.predicted_peak_bytes <= (1 + MEMORY_SLACK) * best

    upper = float(RANGE_FACTORS[-1])  # not tried beyond: a larger size is captured again
    for factor in RANGE_FACTORS:
        if not ok(factor):
            upper = _narrow(ok, factor / 2, factor)
            break
    lower: float | None = None
    if policy.budget is not None and policy.budget.fraction is None:
        # A byte budget holds at every smaller size, but the plan recomputes what its own size
        # needs: below half of it a cheaper plan fits, and the size is captured again.
        lower = 1 / RANGE_FACTORS[0]
    else:
        for factor in RANGE_FACTORS:
            if all(v <= 2 for v in hints.values()):
                break
            if not ok(1 / factor):
                lower = _narrow(ok, 2 / factor, 1 / factor)
                break
            if all(v / factor <= 2 for v in hints.values()):
                break
    out: dict[Any, tuple[int | None, int | None]] = {}
    for symbol, value in hints.items():
        lo = math.ceil(value * lower) if lower is not None else None
        out[symbol] = (lo if lo is not None and lo > 2 else None, math.floor(value * upper))
    return out
