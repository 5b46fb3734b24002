"""Which plan to keep when each one tried is compiled and measured: a search over headroom.

Why: under ``executor="inductor"`` the simulator's peak is only an estimate of what runs (it
replays eager's kernels and their scratch; Inductor fuses, lays out and orders kernels itself), so
the planner's choice is checked by compiling the plan and measuring it once
(``execution.inductor_fit``). The estimate errs both ways: a transformer's compiled plans peaked
up to 1.3x their simulation, a U-Net's least-peak plan 0.85x. Erring high, a plan is over its
budget; erring low, a cheaper plan would have fitted. Both are corrected by the same knob:
``headroom``, bytes taken off (or, negative, added to) the budget the planner plans against.

The search: the first plan is planned with no headroom. While nothing tried fits, the excess of
the last plan's measured peak over its simulation is taken off (as before this search existed).
While everything tried fits and the last plan's simulation overstated its measurement, the
shortfall is given back, so a cheaper plan is tried. Once one headroom fitted and another did not,
the next lies between them (bisection); so does a headroom no plan leaves, halfway back towards the
last that did. Where the limit is the first plan's own compiled peak (``"memory"``, a fraction
reached only at a plan's peak) and that peak overshot its simulation, half the excess is given
back: another plan may compile lower than the first; where half plans the first plan again, all
of it. It stops after ``tries`` compiles, when a plan repeats, or when nothing cheaper is likely
(a plan that fits and whose simulation did not overstate it) or worth another compile (a plan
that fits and recomputes at most 2% of its forward). The cheapest plan that fitted is kept.

It is pure: compiling and measuring is the caller's ``measured`` function, planning its ``plan``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from memfit.planning.budget import BudgetError
from memfit.planning.plan import GraphPlan

__all__ = ["Tried", "search_plans"]

T = TypeVar("T")


class Tried(Generic[T]):
    """One plan compiled: the plan with its measured peaks, and what compiling it made."""

    def __init__(self, plan: GraphPlan, made: T) -> None:
        self.plan = plan
        self.made = made


def search_plans(
    first: GraphPlan,
    measured: Callable[[GraphPlan], Tried[T]],
    plan: Callable[[int], GraphPlan],
    limit_bytes: int | None,
    *,
    tries: int,
    at_least_peak: bool = False,
    at_least_first: bool = False,
    resolution_bytes: int = 0,
) -> tuple[list[Tried[T]], int | None]:
    """The plans tried, in order, and the limit they were held to.

    ``first`` is the plan at no headroom; ``measured(p)`` compiles and measures ``p`` (its
    ``predicted_peak_bytes`` then the measured peak); ``plan(h)`` plans again with ``h`` bytes of
    headroom (BudgetError: nothing there). ``limit_bytes`` is what a plan's measured peak must not
    exceed (None: no limit, one try). With ``at_least_peak`` it is the first plan's measured
    peak: a cheaper plan that peaks no higher is searched. With ``at_least_first`` it is raised to
    the first plan's measured peak where that is higher (a budget that is itself the first plan's
    simulated peak: a fraction only plans at that peak keep), and otherwise stays. Bisection stops
    once the headroom that fitted and the one that did not are within ``resolution_bytes``.
    """
    done: list[Tried[T]] = []
    seen = []
    fit_h: int | None = None  # the least headroom whose plan fitted
    over_h: int | None = None  # the most headroom whose plan did not
    headroom = 0
    current = first
    while True:
        further: int | None = None  # a headroom to try if ``headroom`` plans a plan again
        tried = measured(current)
        done.append(tried)
        seen.append(current.decisions)
        peak = tried.plan.predicted_peak_bytes
        if at_least_peak and limit_bytes is None:
            limit_bytes = peak
        if at_least_first and len(done) == 1 and limit_bytes is not None:
            limit_bytes = max(limit_bytes, peak)
        if limit_bytes is None or len(done) >= tries:
            break
        gap = peak - current.predicted_peak_bytes  # measured over simulated
        if peak > limit_bytes:
            over_h = headroom if over_h is None else max(over_h, headroom)
        else:
            fit_h = headroom if fit_h is None else min(fit_h, headroom)
        if fit_h is None:  # nothing fits yet: take the excess off
            headroom = max(headroom, gap) + 1
        elif over_h is None:  # everything fits so far
            if len(done) == 1 and limit_bytes == peak and gap > 0 and _worth_a_compile(tried.plan):
                # The limit is this plan's own compiled peak (at_least_peak / at_least_first),
                # which overshot its simulation: compiled peaks do not follow the simulation's
                # order, so a plan simulated up to that peak may compile lower. Half the excess
                # back (bisection goes on from there): the frontier's CPU transformer's least
                # simulated plan compiled at 1.38x (20.4 MB), the next one up at 1.05x (17.4).
                headroom = fit_h - gap // 2
                further = fit_h - gap  # all of it, if half plans the first plan again
            elif gap >= 0 or not _worth_a_compile(tried.plan):
                break  # nothing cheaper is likely to fit, or to be worth compiling
            else:
                headroom = fit_h + gap  # give the shortfall back: a cheaper plan may fit
        else:
            if fit_h - over_h <= max(resolution_bytes, 1):
                break
            headroom = (fit_h + over_h) // 2
        again = _replan(plan, headroom, over_h if fit_h is None else None, resolution_bytes)
        if (again is None or again.decisions in seen) and further is not None:
            # Half the excess planned nothing new: the next plan up is further off. Give all
            # of it back (a plan simulated up to the first one's compiled peak) before stopping.
            headroom = further
            again = _replan(plan, headroom, None, resolution_bytes)
        if again is None or again.decisions in seen:
            break
        current = again
    return done, limit_bytes


#: A plan that fits and recomputes at most this share of its forward's FLOPs is kept without
#: looking for a cheaper one: one more compile (seconds to minutes) would save too little.
WORTH_A_COMPILE = 0.02


def _worth_a_compile(plan: GraphPlan) -> bool:
    return plan.cost_seconds > 0 and plan.recompute_flops > WORTH_A_COMPILE * plan.forward_flops


def _replan(
    plan: Callable[[int], GraphPlan], headroom: int, over_h: int | None, resolution_bytes: int
) -> GraphPlan | None:
    """``plan(headroom)``; where no plan leaves that much headroom and only a smaller one was
    tried (``over_h``, over the limit), the headroom halfway back, until one plans or the two
    are within ``resolution_bytes``. None: no plan to try."""
    while True:
        try:
            return plan(headroom)
        except BudgetError:
            if over_h is None or headroom - over_h <= max(resolution_bytes, 1):
                return None
            headroom = (over_h + headroom) // 2
