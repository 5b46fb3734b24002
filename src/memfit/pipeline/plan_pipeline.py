"""``memfit.pipeline.plan``: where to cut a model into stages over K ranks, and what each costs.

``plan`` checks its options before anything runs (``pipeline_options.configure``,
``pipeline_options.microbatch``), captures and profiles the model on one micro-batch
(``costs.prepare_search``), and runs the cut search with memfit's planner checking every rank
(``cut_search.plan_from_search``); what each stage keeps, holds and costs is ``stages.StagePlan``,
the schedules' part ``schedule``. With ``schedule="auto"`` it does so for every configuration and
keeps the fastest that fits (``auto``). ``Pipeline`` (``runtime``) takes the same arguments and runs
the same search.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from memfit.pipeline.auto import choose
from memfit.pipeline.costs import prepare_search
from memfit.pipeline.cut_search import plan_from_search
from memfit.pipeline.pipeline_options import (
    PipelineOptions,
    configure,
    deprecated_keywords,
    is_auto,
    microbatch,
)
from memfit.pipeline.stages import PipelinePlan

__all__ = ["plan"]


def plan(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    *,
    ranks: int | None = None,
    options: PipelineOptions | None = None,
    **deprecated: Any,
) -> PipelinePlan:
    """Plan ``model`` as a pipeline over ``ranks`` ranks (K, one device each).

    ``example_inputs`` (a tensor or a tuple of the model's positional arguments) is one
    mini-batch; it is split into ``options.microbatches`` equal micro-batches along dim 0.
    ``options`` (``PipelineOptions``, each field documented there) gives the schedule, the
    stages per rank, the per-device budget (met by each rank's stages together), offload, the
    optimizer state and the runtime's overhead and latency; ``schedule="auto"`` compares every
    configuration and keeps the fastest predicted that fits, and ``str(plan)`` ends with the
    table of candidates. Raises ``memfit.BudgetError`` naming the least budget when no split
    fits, and ``ValueError`` for options no pipeline can honour, before anything runs.
    ``loss_fn`` is not needed to plan (the loss runs after the last stage); it is accepted so
    ``plan`` and ``Pipeline`` take the same arguments. Changes nothing in the model.

    The keywords of memfit 0.1 (``stages=K``, ``microbatches=``, ``schedule=``, ...) are
    accepted until the next release, with a ``DeprecationWarning`` giving the new spelling.
    """
    del loss_fn
    ranks, options = deprecated_keywords("plan", ranks, options, deprecated)
    config = configure(ranks, options)
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    if is_auto(options.schedule):
        return choose(model, inputs, ranks, options)
    micro = microbatch(inputs, config.microbatches)
    return plan_from_search(prepare_search(model, micro, options.max_items), micro, config)
