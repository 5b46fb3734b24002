"""``schedule="auto"``: the schedule, stages per rank, micro-batches and stage plans, chosen.

For one model, one mini-batch, K devices and a per-device budget, every configuration torch's
rules allow is planned as ``plan`` plans it (exact cuts, each rank's stages planned together by
memfit's planner: keep, recompute, and with ``offload=True`` offload what a micro-batch keeps
while it waits for its backward) and the one with the least predicted step, so the most samples
per second for the batch, is kept; ties go to the smaller peak, then fewer stages per rank. What
is compared:

* schedules: torch's seven (``PipelineSchedule``);
* stages per rank: 1 for GPipe and 1F1B, 2 for the V schedules, 2 and 4 for interleaved and
  looped ones (more stages per rank shrink the bubble, at more transfers and a smaller share of
  the model per stage), or only the count asked for;
* micro-batches: the count asked for, or divisors of the batch near K, 2K, 4K and 8K (more
  micro-batches shrink the bubble, but each is smaller and is profiled as such: a device runs a
  small micro-batch less efficiently, which the profile sees).

Each micro-batch count is captured and profiled once (``costs.prepare_search``); memfit's plans
of a stage span are shared by every schedule that cuts the same span (``Search.stage_plans``).
Configurations torch's rules exclude (1F1B with ``M < K``, ...) are not planned; those whose
every split is over the budget are listed with the least per-device peak memfit reached for
them. When none fits, ``BudgetError`` names the least reachable per-device peak over all of
them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch.nn as nn

from memfit.pipeline.candidates import Candidate, candidate_table
from memfit.pipeline.costs import Search, prepare_search
from memfit.pipeline.cut_search import plan_from_search
from memfit.pipeline.partition import PipelineCaptureError
from memfit.pipeline.pipeline_options import Configuration, PipelineOptions, configure, microbatch
from memfit.pipeline.schedule import (
    PipelineSchedule,
    check_schedule,
    is_single,
    is_v_shaped,
)
from memfit.pipeline.stages import PipelinePlan
from memfit.planning.budget import BudgetError
from memfit.units import format_bytes

__all__ = ["choose", "configurations", "microbatch_counts"]


def microbatch_counts(batch: int, ranks: int) -> list[int]:
    """Micro-batch counts to compare: the largest divisor of ``batch`` at or below each of K,
    2K, 4K and 8K (so every micro-batch is equal), without repeats."""
    divisors = [d for d in range(1, batch + 1) if batch % d == 0]
    counts = []
    for target in (ranks, 2 * ranks, 4 * ranks, 8 * ranks):
        best = max(d for d in divisors if d <= target)
        if best not in counts:
            counts.append(best)
    return counts


def configurations(
    ranks: int, counts: list[int], stages_per_rank: int | None
) -> Iterator[tuple[PipelineSchedule, int, int]]:
    """``(schedule, stages per rank, micro-batches)`` that torch's rules allow, in the order
    the table lists them."""
    for schedule in PipelineSchedule:
        if is_single(schedule):
            per_rank = [1]
        elif is_v_shaped(schedule):
            per_rank = [2]
        else:
            per_rank = [2, 4]
        if stages_per_rank is not None:
            per_rank = [v for v in per_rank if v == stages_per_rank]
        for v in per_rank:
            for m in counts:
                try:
                    check_schedule(schedule, ranks, m, v)
                except ValueError:
                    continue
                yield schedule, v, m


def _candidate(plan: PipelinePlan) -> Candidate:
    compute = sum(3 * s.forward_seconds for s in plan.stages)
    added = sum(s.recompute_seconds + s.stall_seconds for s in plan.stages)
    return Candidate(
        schedule=plan.schedule,
        stages_per_rank=plan.stages_per_rank,
        microbatches=plan.microbatches,
        step_seconds=plan.step_seconds,
        bubble=plan.bubble,
        peak_bytes=plan.peak_bytes,
        added_share=added / compute if compute else 0.0,
        offloaded_bytes=plan.microbatches * sum(s.offloaded_bytes for s in plan.stages),
    )


def choose(
    model: nn.Module, inputs: tuple[Any, ...], ranks: int, options: PipelineOptions
) -> PipelinePlan:
    """The plan of the configuration with the least predicted step that fits over ``ranks``
    ranks; its ``candidates`` are every configuration compared. ``options`` gives the budget,
    optimizer state, bandwidth, offload, overhead and latency, and, when set, the only
    micro-batch count and stages per rank to compare (its schedule is ``"auto"``).

    Raises ``BudgetError`` with the least reachable per-device peak when none fits.
    """
    base = configure(ranks, options)
    microbatches, max_items = options.microbatches, options.max_items
    batch = _batch(inputs)
    counts = [microbatches] if microbatches is not None else microbatch_counts(batch, ranks)
    searches: dict[int, tuple[Search, tuple[Any, ...]] | PipelineCaptureError] = {}
    fitting: list[tuple[Candidate, PipelinePlan]] = []
    candidates: list[Candidate] = []
    for schedule, v, m in configurations(ranks, counts, options.stages_per_rank):
        if m not in searches:
            micro = microbatch(inputs, m)
            try:
                searches[m] = (prepare_search(model, micro, max_items), micro)
            except PipelineCaptureError as err:  # BatchNorm on a micro-batch of one, ...
                searches[m] = err
        found = searches[m]
        if isinstance(found, PipelineCaptureError):
            reason = f"not captured at this micro-batch size: {_first_line(found)}"
            candidates.append(Candidate(schedule, v, m, None, None, None, refused=reason))
            continue
        search, micro = found
        these = _configured(base, schedule, v, m)
        try:
            planned = plan_from_search(search, micro, these, exact=False)
        except BudgetError as err:
            candidates.append(
                Candidate(schedule, v, m, None, None, err.least_bytes, refused="over budget")
            )
            continue
        except ValueError as err:  # more stages than candidate cuts
            candidates.append(Candidate(schedule, v, m, None, None, None, refused=str(err)))
            continue
        fitting.append((_candidate(planned), planned))
        candidates.append(fitting[-1][0])
    if not fitting:
        errors = [e for e in searches.values() if isinstance(e, PipelineCaptureError)]
        if len(errors) == len(searches):
            raise errors[0]
        raise _nothing_fits(candidates, base.budget, ranks)
    best, _ = min(fitting, key=lambda cp: cp[0].key())
    # compared on the frontier points' own numbers; what runs is each stage planned again at
    # its point's peak (``stage_planner``), which may keep less: the chosen row shows that
    found = searches[best.microbatches]
    assert not isinstance(found, PipelineCaptureError)
    search, micro = found
    settings = (best.schedule, best.stages_per_rank, best.microbatches)
    chosen = plan_from_search(search, micro, _configured(base, *settings))
    marked = tuple(
        dataclasses.replace(_candidate(chosen), chosen=True) if c is best else c for c in candidates
    )
    return dataclasses.replace(chosen, candidates=marked)


def _configured(
    base: Configuration, schedule: PipelineSchedule, per_rank: int, m: int
) -> Configuration:
    return dataclasses.replace(base, microbatches=m, schedule=schedule, stages_per_rank=per_rank)


def _first_line(err: Exception) -> str:
    text = str(err)
    return text.split(": ", 1)[-1].splitlines()[0][:80] if text else type(err).__name__


def _batch(inputs: tuple[Any, ...]) -> int:
    microbatch(inputs, 1)  # the same checks: a tensor input, one batch size
    return next(t.shape[0] for t in inputs if hasattr(t, "shape") and len(t.shape) > 0)


def _nothing_fits(candidates: list[Candidate], budget: int | None, ranks: int) -> BudgetError:
    reached = [c for c in candidates if c.peak_bytes is not None]
    table = candidate_table(candidates)
    if not reached:
        return BudgetError(
            f"no pipeline over {ranks} devices could be planned:\n{table}", budget_bytes=budget
        )
    least = min(reached, key=lambda c: c.peak_bytes or 0)
    return BudgetError(
        f"no pipeline over {ranks} devices fits {format_bytes(budget or 0)} per device; the "
        f"least reachable per-device peak is about {format_bytes(least.peak_bytes or 0)} "
        f"({least.schedule}, {least.stages_per_rank} per rank, {least.microbatches} "
        f"micro-batches):\n{table}",
        budget_bytes=budget,
        least_bytes=least.peak_bytes,
    )
