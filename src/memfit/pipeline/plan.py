"""``memfit.pipeline.plan``: where to cut a model into K stages, and what each stage will cost.

``plan`` checks its arguments before anything runs (``pipeline_options``, ``microbatch``),
captures and profiles the model on one micro-batch (``costs.prepare_search``), and runs the cut
search with memfit's planner checking every rank (``search.search_stages``); what each stage
keeps, holds and costs is ``stages.StagePlan``, the schedules' part ``schedule``. With
``schedule="auto"`` it does so for every configuration and keeps the fastest that fits
(``auto``). ``Pipeline`` (``runtime``) makes the same checks and runs the same search.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from memfit.pipeline.costs import Search, prepare_search
from memfit.pipeline.schedule import (
    PipelineSchedule,
    as_schedule,
    check_schedule,
    default_stages_per_rank,
)
from memfit.pipeline.search import search_stages
from memfit.pipeline.stages import PipelineOptions, PipelinePlan
from memfit.planning.budget import parse_budget

__all__ = ["AUTO", "is_auto", "microbatch", "pipeline_options", "plan", "plan_from_search"]

#: ``schedule=AUTO``: memfit chooses the schedule, stages per rank and micro-batches (``auto``).
AUTO = "auto"


def is_auto(schedule: PipelineSchedule | str) -> bool:
    """Whether ``schedule`` asks memfit to choose (``"auto"``, any case)."""
    return isinstance(schedule, str) and schedule.strip().lower() == AUTO


def microbatch(example_inputs: tuple[Any, ...], microbatches: int) -> tuple[Any, ...]:
    """The first of ``microbatches`` equal chunks (along dim 0) of every tensor input.

    The schedule splits a mini-batch with ``tensor_split`` along dim 0; memfit plans for equal
    micro-batches, so every tensor's first dimension must be the same multiple of ``M``.
    """
    sizes = {t.shape[0] for t in example_inputs if isinstance(t, torch.Tensor) and t.dim() > 0}
    if not sizes:
        raise ValueError("the pipeline needs at least one tensor input with a batch dimension")
    if len(sizes) > 1:
        raise ValueError(f"tensor inputs have different batch sizes {sorted(sizes)} (dim 0)")
    batch = sizes.pop()
    if batch % microbatches:
        raise ValueError(
            f"a batch of {batch} does not split into {microbatches} equal micro-batches; "
            f"use a batch size that is a multiple of {microbatches}"
        )
    return tuple(
        t.tensor_split(microbatches)[0] if isinstance(t, torch.Tensor) and t.dim() > 0 else t
        for t in example_inputs
    )


def pipeline_options(
    *,
    stages: int,
    microbatches: int | None,
    schedule: PipelineSchedule | str,
    budget: int | str | None,
    optimizer_state: float,
    bandwidth: float | None,
    stages_per_rank: int | None = None,
    offload: bool = False,
    overhead: float = 0.0,
    latency: float = 0.0,
) -> PipelineOptions:
    """The arguments of ``plan`` and ``Pipeline``, checked: ``ValueError`` for any that no
    pipeline can honour, before anything runs. ``stages`` is K, the ranks (devices); the
    options' ``stages`` counts every stage, ``stages_per_rank`` on each. Under ``"auto"``
    the schedule, stages and micro-batches in them are placeholders (GPipe) that ``auto``
    replaces; ``microbatches`` may then be None (memfit chooses)."""
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be a positive integer, got {stages!r}")
    auto = is_auto(schedule)
    if not (auto and microbatches is None) and (
        not isinstance(microbatches, int) or microbatches < 1
    ):
        raise ValueError(
            f"microbatches must be a positive integer, got {microbatches!r}"
            + ("" if auto else " (only schedule='auto' chooses it)")
        )
    if stages_per_rank is not None and (
        not isinstance(stages_per_rank, int) or stages_per_rank < 1
    ):
        raise ValueError(f"stages_per_rank must be a positive integer, got {stages_per_rank!r}")
    if not isinstance(offload, bool):
        raise ValueError(f"offload is True or False, got {offload!r}")
    chosen = PipelineSchedule.GPIPE if auto else as_schedule(schedule)
    per_rank = default_stages_per_rank(chosen) if stages_per_rank is None else stages_per_rank
    if not auto:
        check_schedule(chosen, stages, microbatches or 1, per_rank)
    if not math.isfinite(optimizer_state) or optimizer_state < 0:
        raise ValueError("optimizer_state must be >= 0 bytes per parameter byte")
    for name, seconds in (("overhead", overhead), ("latency", latency)):
        if not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"{name} is seconds >= 0, got {seconds!r}")
    per_device = _budget_per_device(budget)
    if auto:
        per_rank, microbatches = 1, microbatches or 1
    assert microbatches is not None
    return PipelineOptions(
        stages=stages * per_rank,
        microbatches=microbatches,
        schedule=chosen,
        budget=per_device,
        optimizer_state=optimizer_state,
        bandwidth=bandwidth,
        stages_per_rank=per_rank,
        offload=offload,
        overhead=float(overhead),
        latency=float(latency),
    )


def _budget_per_device(budget: int | str | None) -> int | None:
    if budget is None:
        return None
    parsed = parse_budget(budget)
    if parsed.bytes is None:
        raise ValueError(
            "a pipeline budget is bytes per device (an int or a size such as '2GiB'), "
            "not a fraction"
        )
    return parsed.bytes


def plan(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    *,
    stages: int,
    microbatches: int | None = None,
    schedule: PipelineSchedule | str = PipelineSchedule.GPIPE,
    budget: int | str | None = None,
    optimizer_state: float = 0.0,
    bandwidth: float | None = None,
    max_items: int = 128,
    stages_per_rank: int | None = None,
    offload: bool = False,
    overhead: float = 0.0,
    latency: float = 0.0,
) -> PipelinePlan:
    """Plan ``model`` as a pipeline over ``stages`` devices and ``microbatches`` micro-batches.

    ``example_inputs`` (a tensor or a tuple of the model's positional arguments) is one
    mini-batch; it is split into equal micro-batches along dim 0. ``stages`` is K, the ranks
    (devices). ``schedule`` is a ``PipelineSchedule`` or its name (``"gpipe"``, ``"1f1b"``,
    ``"interleaved_1f1b"``, ``"looped_bfs"``, ``"interleaved_zero_bubble"``,
    ``"zbv_zero_bubble"``, ``"dualpipev"``); the last five cut ``stages_per_rank x K`` stages
    (default 2 per rank; V schedules exactly 2). ``"auto"`` compares them all, with stages per
    rank and micro-batch counts (``microbatches=None``: memfit chooses; given: that count), and
    keeps the fastest predicted that fits; ``str(plan)`` ends with the table of candidates.
    ``budget`` is bytes per device (``"2GiB"``), met by each rank's stages together;
    ``offload=True`` lets memfit's planner offload what a micro-batch keeps while it waits for
    its backward. ``overhead`` (seconds each forward and backward costs the schedule's runtime
    beyond the stage, about 2 ms over gloo on a 2-core CPU) and ``latency`` (seconds between
    ranks) join the predicted step, which ``"auto"`` compares. Raises ``memfit.BudgetError``
    naming the least budget when no split fits, and ``ValueError`` for arguments no pipeline can
    honour, before anything runs. ``loss_fn`` is not needed to plan (the loss runs after the
    last stage); it is accepted so ``plan`` and ``Pipeline`` take the same arguments. Changes
    nothing in the model.
    """
    del loss_fn
    options = pipeline_options(
        stages=stages,
        microbatches=microbatches,
        schedule=schedule,
        budget=budget,
        optimizer_state=optimizer_state,
        bandwidth=bandwidth,
        stages_per_rank=stages_per_rank,
        offload=offload,
        overhead=overhead,
        latency=latency,
    )
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    if is_auto(schedule):
        from memfit.pipeline.auto import choose

        return choose(
            model,
            inputs,
            options,
            ranks=stages,
            microbatches=microbatches,
            stages_per_rank=stages_per_rank,
            max_items=max_items,
        )
    micro = microbatch(inputs, options.microbatches)
    return plan_from_search(prepare_search(model, micro, max_items), micro, options)


def plan_from_search(
    search: Search, micro: tuple[Any, ...], options: PipelineOptions, *, exact: bool = True
) -> PipelinePlan:
    """The plan of ``options``'s pipeline over a captured and profiled model (``search``, on
    the micro-batch ``micro``; ``exact``: see ``stage_planner``)."""
    found = search_stages(search, micro, options, exact=exact)
    return PipelinePlan(
        stages=tuple(found.plans[s] for s in range(len(found.graphs))),
        schedule=options.schedule,
        microbatches=options.microbatches,
        cuts=tuple(found.cuts),
        budget_bytes=options.budget,
        candidate_cuts=search.costs.count - 1,
        stages_per_rank=options.stages_per_rank,
        overhead=options.overhead,
        latency=options.latency,
    )
