"""What a memfit wrapper tells its user after a call: its one-time warnings and their texts.

Each warning says what happened, what memfit did about it, and what the user can do; the call's
session (``execution.session``) decides when one is due and gives it through ``CallWarnings``,
which gives each kind once per wrapper (``Once``): a training loop is told once, not every step
(STYLE: "Warnings once, not per step, naming the user's line"). Kept apart so the session reads
as what it does, and so each text can be read whole. The graph-break warning is the capture's
(``capture.graph_breaks``, once per break); the session adds to it what memfit does about the
breaks (``break_action``).
"""

from __future__ import annotations

import enum

from memfit.capture.graph_breaks import GraphBreakReport, loop_skip_message
from memfit.execution.regions import Regions, recomputes_regions
from memfit.planning.plan import GraphPlan
from memfit.planning.policy import Policy
from memfit.units import format_bytes
from memfit.warn import warn_user

__all__ = [
    "CallWarnings",
    "INDUCTOR_BUDGET_WARNING",
    "Once",
    "break_action",
    "budget_missed",
    "held_outside",
    "loss_outside_unseen",
    "SWAP_LITTLE",
    "step_over_budget",
    "swap_saved_little",
    "unplanned",
]


class Once(enum.Enum):
    """The warnings a wrapper gives at most once each."""

    #: a training call ran none of memfit's graphs (``unplanned``)
    UNPLANNED = enum.auto()
    #: the step held more outside memfit's graphs than the plan allowed for (``held_outside``)
    HELD_OUTSIDE = enum.auto()
    #: a plan for a range of sizes is over its budget at a size that ran (``budget_missed``)
    BUDGET_MISSED = enum.auto()
    #: ``"swap"`` offloaded little or nothing (``swap_saved_little``)
    SWAP_LITTLE = enum.auto()
    #: a budget on CPU with the loss computed outside, unmeasured (``loss_outside_unseen``)
    LOSS_OUTSIDE_UNSEEN = enum.auto()
    #: a step with graph breaks memfit could not bring within its budget (``step_over_budget``)
    STEP_OVER_BUDGET = enum.auto()
    #: a budget with offload run through Inductor is not guaranteed (``INDUCTOR_BUDGET_WARNING``)
    INDUCTOR_BUDGET = enum.auto()


class CallWarnings:
    """The one place a wrapper's warnings are given: each kind once (``Once``)."""

    def __init__(self) -> None:
        self.given: set[Once] = set()

    def due(self, kind: Once) -> bool:
        """Whether ``kind`` has not been given yet (asked before a text costs anything)."""
        return kind not in self.given

    def give(self, kind: Once, text: str) -> None:
        """Warn with ``text``, pointing at the user's line, unless ``kind`` was given before."""
        if kind in self.given:
            return
        self.given.add(kind)
        warn_user(text)


#: Said once per wrapper that plans a budget with offload and runs it through Inductor: such
#: plans are not measured after compiling (``execution.partitioner``), only simulated.
INDUCTOR_BUDGET_WARNING = (
    "executor='inductor' with a budget and offload: memfit plans offload against its op-by-op "
    "simulation of the graphs, but Inductor schedules and allocates its fused kernels itself "
    "and can peak above that prediction (measured up to 1.3x on a transformer encoder), so the "
    "budget is not guaranteed; use executor='eager' (the default) for a budget that must hold"
)


#: Below this share of what it would otherwise keep, a ``"swap"`` plan is said to save little.
SWAP_LITTLE = 0.10


def swap_saved_little(name: str, offloaded_bytes: int, kept_bytes: int) -> str | None:
    """What to tell a user whose ``"swap"`` offloaded nothing, or under ``SWAP_LITTLE`` of the
    saved values it would keep (``kept_bytes`` on the device after offload); None when it saved
    enough to say nothing.

    Why: on a MobileNet-like net on CPU (disk), ``"swap"`` offloaded 1 MiB of the 313 MiB it
    kept, peaking at 337.5 MB against plain's 339.8, and said nothing: the old warning came only
    when nothing at all was offloaded."""
    total = offloaded_bytes + kept_bytes
    if total and offloaded_bytes >= SWAP_LITTLE * total:
        return None
    if not offloaded_bytes:
        what = "offloaded nothing"
    else:
        what = (
            f"offloaded only {format_bytes(offloaded_bytes)} of the {format_bytes(total)} it "
            "would keep"
        )
    return (
        f"policy 'swap' {what} in {name}: it offloads only copies that hide behind compute, "
        "and here few can (measured overlap of copies with compute is small or none, as on a "
        "CPU), so the plan keeps about what plain PyTorch keeps. To save memory anyway, "
        "recompute ('memory', or a budget), or trade time for memory by offloading with a "
        "predicted stall: memfit.checkpoint(model, '2GiB', offload=True) with a budget of your own"
    )


def loss_outside_unseen(name: str, output_bytes: int) -> str:
    """A budget on CPU whose loss is computed outside the model, where memfit cannot see it
    (another profiler runs over the step, so memfit can open no session of its own)."""
    return (
        f"{name} returns no loss, so the training step computes one outside it, "
        "and on CPU memfit cannot see what that code holds between the forward and the "
        f"backward (a cross-entropy over logits holds about as much as they take: "
        f"{format_bytes(output_bytes)} here) while another profiler runs: "
        f"the budget covers {name}'s graphs only until memfit measures a step outside it. "
        "Compute the loss inside (memfit.step(fn) with the loss computed in fn plans it "
        "too), or run one step inside memfit.measure(...) and memfit reserves what it "
        "measures from the next call."
    )


def break_action(regions: Regions | None, policy: Policy, chained: bool) -> str | None:
    """What memfit does about the graph breaks of the last call, for the break warning (None:
    the warning's default, each piece on its own and values crossing a break kept).
    ``chained``: the graph runs form a chain (``execution.run_chain``)."""
    chain = (
        "memfit runs the graphs as one chain: from the next calls, segments of graph runs keep "
        "only the values that enter them and run their compiled graphs again in the backward "
        "(the branches taken are not decided again)"
    )
    if regions is not None and regions.chosen:
        return (
            f"From the next call on, memfit recomputes each call of "
            f"{regions.describe()} whole in the backward pass, as "
            f"torch.utils.checkpoint(use_reentrant=False) does: only its inputs are kept, "
            f"its Python runs again with the forward's random state, and its buffers "
            f"(BatchNorm statistics) are updated once. Elsewhere each piece is checkpointed "
            f"on its own and values that cross a break are kept"
        )
    inside = regions.modules_with_breaks if regions is not None else []
    if inside and not recomputes_regions(policy):
        return (
            f"Each piece is checkpointed on its own, and values that cross a break and what "
            f"the Python between pieces saves are kept: policy {policy.label!r} does "
            f"not recompute the modules the breaks are in ({', '.join(inside[:3])}"
            f"{', ...' if len(inside) > 3 else ''}); 'memory' or a budget would"
        )
    if chained:
        return chain[0].upper() + chain[1:]
    return None


def unplanned(
    name: str, full: bool, shapes_planned: int, max_shapes: int, report: GraphBreakReport
) -> str:
    """Why a training call ran none of memfit's graphs."""
    if report.frame_skipped:
        # the one warning says both: the break, and that nothing was planned because of it
        return loop_skip_message(name, report.reasons)
    if full:
        return (
            f"memfit has captured and planned {name} {shapes_planned} times "
            f"(Options.max_shapes={max_shapes}: input shapes, or ranges of sizes) and ran "
            "this call, which needed another capture, as plain PyTorch, without a plan or "
            "savings; pad or bucket inputs to fewer shapes, or raise "
            "memfit.Options(max_shapes=...)"
        )
    return (
        f"{name} ran as plain PyTorch, without a plan or savings: torch.compile "
        "did not run memfit's graphs for this call (see TORCH_LOGS=recompiles)"
    )


def budget_missed(name: str, plan: GraphPlan) -> str:
    """A plan chosen for a range of sizes predicts more than its budget at the size that ran."""
    sizes = ", ".join(f"{n}={value}" for n, value in plan.sizes)
    chosen = ", ".join(f"{n}={value}" for n, value in plan.planned_sizes)
    return (
        f"{name}'s plan, chosen at {chosen}, predicts "
        f"{format_bytes(plan.predicted_peak_bytes)} at {sizes}, above its budget of "
        f"{format_bytes(plan.budget_bytes or 0)}; memfit plans again from the next call"
    )


def held_outside(name: str, outside: int, step_peak: int, predicted: int) -> str:
    """The step held ``outside`` bytes outside memfit's graphs between forward and backward,
    and so peaked near ``step_peak``, above the plan's ``predicted`` peak."""
    return (
        f"the training step held {format_bytes(outside)} outside memfit's graphs of "
        f"{name} between its forward and backward (a loss computed outside the "
        f"model, or other code), so it peaked near {format_bytes(step_peak)} against "
        f"{format_bytes(predicted)} predicted; memfit plans {name} "
        f"again with that reserved, so its budget and prediction hold from the next "
        f"call. Compute the loss inside memfit.step to plan it too."
    )


def step_over_budget(name: str, graphs: int, budget: int, predicted: int) -> str:
    """A step of ``graphs`` graphs (graph breaks) still over its budget after the rounds of
    planning the step as a whole."""
    return (
        f"{name} runs in {graphs} graphs (graph breaks) and memfit "
        f"could not bring the whole step within its budget of "
        f"{format_bytes(budget)}: predicted peak "
        f"{format_bytes(predicted)}. Remove the graph breaks or "
        f"give a larger budget."
    )
