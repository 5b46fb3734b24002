"""What a pipeline is asked: ``PipelineOptions``, and the checked ``Configuration`` it becomes.

``plan``, ``Pipeline``, ``schedule="auto"`` and ``memfit pipeline`` take the same few arguments:
the model, one example mini-batch, the number of ranks K (one device each) and one
``PipelineOptions``, whose fields are documented where they are declared (as ``memfit.Options``
and torchtitan's configs are) and hold the only default of each knob. ``configure`` checks them
once, before anything runs, and turns them into a ``Configuration``: plain data in the terms the
cut search and the stage planner read (the schedule as a ``PipelineSchedule``, the budget in
bytes, every stage counted), so nothing below this module sees what the user wrote.

The keywords ``plan`` and ``Pipeline`` took before (``stages=K``, which counted ranks, and one
keyword per option) are still accepted for one release (``deprecated_keywords``): they are
read from ``PipelineOptions``' own fields, so the list is written once, here.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from memfit.pipeline.schedule import (
    PipelineSchedule,
    as_schedule,
    check_schedule,
    default_stages_per_rank,
)
from memfit.planning.budget import parse_budget

__all__ = [
    "AUTO",
    "Configuration",
    "PipelineOptions",
    "configure",
    "deprecated_keywords",
    "is_auto",
    "microbatch",
]

#: ``schedule=AUTO``: memfit chooses the schedule, stages per rank and micro-batches (``auto``).
AUTO = "auto"


@dataclass(frozen=True)
class PipelineOptions:
    """How a pipeline over K ranks runs and what each rank may hold; every field has a default.

    Pass it as ``options=`` to ``memfit.pipeline.plan`` and ``memfit.pipeline.Pipeline`` (the
    same object to both: ``Pipeline`` then runs what ``plan`` printed).
    """

    #: M, the micro-batches each mini-batch is split into (equal, along dim 0). None is allowed
    #: only under ``schedule="auto"``, which then chooses it (divisors of the batch near K, 2K,
    #: 4K and 8K); given there, only that count is compared.
    microbatches: int | None = None
    #: The order the stages run micro-batches in, a ``PipelineSchedule`` or its name:
    #: ``"gpipe"``, ``"1f1b"`` (one stage per rank), ``"interleaved_1f1b"``, ``"looped_bfs"``,
    #: ``"interleaved_zero_bubble"``, ``"zbv_zero_bubble"``, ``"dualpipev"`` (several), or
    #: ``"auto"``: memfit plans every schedule, stages per rank and micro-batch count torch's
    #: rules allow and keeps the least predicted step that fits.
    schedule: PipelineSchedule | str = PipelineSchedule.GPIPE
    #: V, the stages each rank holds, so the model is cut into ``V x K`` stages. None: 1 for
    #: GPipe and 1F1B, 2 for the others (V schedules take exactly 2); under ``"auto"``, None
    #: compares 2 and 4 for the interleaved and looped schedules, a number only that one.
    stages_per_rank: int | None = None
    #: Bytes each device may hold at the peak of a step (an int or a size such as ``"2GiB"``;
    #: not a fraction), met by each rank's stages together; None: every stage keeps everything.
    budget: int | str | None = None
    #: Optimizer state in bytes per parameter byte, counted in every rank's peak (2 for Adam,
    #: 1 for SGD with momentum, 0: left out).
    optimizer_state: float = 0.0
    #: Bytes per second between neighbouring ranks, to count each cut's transfer in the stage
    #: times; None: transfers take no time.
    bandwidth: float | None = None
    #: Let memfit's planner offload what a micro-batch keeps while it waits for its backward
    #: (``memfit.checkpoint(..., offload=True)`` on every stage).
    offload: bool = False
    #: Seconds each forward and backward costs the schedule's runtime beyond its stage's own
    #: time (about 2 ms over gloo on a 2-core CPU), counted in the predicted step that
    #: ``"auto"`` compares; 0: the stages' times alone.
    overhead: float = 0.0
    #: Seconds a value takes from one rank to the next, counted at each cut there and back.
    latency: float = 0.0
    #: The most pieces (runs of modules between candidate cuts) the model's forward is grouped
    #: into for the cut search: more finds finer cuts, at more profiling and search time.
    max_items: int = 128


@dataclass(frozen=True)
class Configuration:
    """One pipeline, checked (``configure``): what the cut search and every stage's plan read.
    ``schedule="auto"`` compares many, differing in schedule, stages per rank and
    micro-batches."""

    #: K: the ranks (devices) the stages are placed on
    ranks: int
    #: V: the stages each rank holds (``placement`` says which)
    stages_per_rank: int
    #: M: the micro-batches a mini-batch is split into
    microbatches: int
    #: the order the stages run their micro-batches in (what each holds in flight)
    schedule: PipelineSchedule
    #: bytes per device, or None: every stage keeps everything
    budget: int | None
    #: ``PipelineOptions``' fields of the same names
    optimizer_state: float = 0.0
    bandwidth: float | None = None
    offload: bool = False
    #: NOTE [What a step costs beyond its stages' times]
    overhead: float = 0.0
    latency: float = 0.0

    @property
    def stages(self) -> int:
        """Every stage of the pipeline: ``stages_per_rank`` on each of ``ranks``."""
        return self.ranks * self.stages_per_rank


def is_auto(schedule: PipelineSchedule | str) -> bool:
    """Whether ``schedule`` asks memfit to choose (``"auto"``, any case)."""
    return isinstance(schedule, str) and schedule.strip().lower() == AUTO


def configure(ranks: int, options: PipelineOptions) -> Configuration:
    """``options`` for ``ranks`` ranks, checked: ``ValueError`` for anything no pipeline can
    honour, before anything runs. Under ``"auto"`` the schedule, stages per rank and
    micro-batches are placeholders (GPipe, 1, ``microbatches`` or 1) that ``auto`` replaces."""
    if not isinstance(options, PipelineOptions):
        raise TypeError(
            f"options is a memfit.pipeline.PipelineOptions, got {type(options).__name__}"
        )
    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be a positive integer (the devices), got {ranks!r}")
    auto = is_auto(options.schedule)
    microbatches, per_rank = options.microbatches, options.stages_per_rank
    if not (auto and microbatches is None) and (
        not isinstance(microbatches, int) or microbatches < 1
    ):
        raise ValueError(
            f"microbatches must be a positive integer, got {microbatches!r}"
            + ("" if auto else " (only schedule='auto' chooses it)")
        )
    if per_rank is not None and (not isinstance(per_rank, int) or per_rank < 1):
        raise ValueError(f"stages_per_rank must be a positive integer, got {per_rank!r}")
    if not isinstance(options.offload, bool):
        raise ValueError(f"offload is True or False, got {options.offload!r}")
    if not isinstance(options.max_items, int) or options.max_items < 1:
        raise ValueError(f"max_items must be a positive integer, got {options.max_items!r}")
    chosen = PipelineSchedule.GPIPE if auto else as_schedule(options.schedule)
    if auto:
        per_rank, microbatches = 1, microbatches or 1
    elif per_rank is None:
        per_rank = default_stages_per_rank(chosen)
    assert microbatches is not None and per_rank is not None
    if not auto:
        check_schedule(chosen, ranks, microbatches, per_rank)
    state = options.optimizer_state
    if not isinstance(state, (int, float)) or not math.isfinite(state) or state < 0:
        raise ValueError(f"optimizer_state must be >= 0 bytes per parameter byte, got {state!r}")
    for name, seconds in (("overhead", options.overhead), ("latency", options.latency)):
        if not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"{name} is seconds >= 0, got {seconds!r}")
    return Configuration(
        ranks=ranks,
        stages_per_rank=per_rank,
        microbatches=microbatches,
        schedule=chosen,
        budget=_budget_per_device(options.budget),
        optimizer_state=float(state),
        bandwidth=options.bandwidth,
        offload=options.offload,
        overhead=float(options.overhead),
        latency=float(options.latency),
    )


def _budget_per_device(budget: int | str | None) -> int | None:
    if budget is None:
        return None
    parsed = parse_budget(budget)
    if parsed.bytes is None:
        raise ValueError(
            "a pipeline budget is bytes per device (an int or a size such as '2GiB'), "
            f"not a fraction, got {budget!r}"
        )
    return parsed.bytes


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


def deprecated_keywords(
    where: str, ranks: int | None, options: PipelineOptions | None, keywords: dict[str, Any]
) -> tuple[int, PipelineOptions]:
    """``ranks`` and ``options`` with the keywords ``where`` took before 0.2 folded in.

    ``stages=K`` (which counted ranks) is ``ranks=K``; a keyword named as a field of
    ``PipelineOptions`` is that field. Either warns once (``DeprecationWarning``, at the
    caller's line) with the new spelling; anything else is the ``TypeError`` Python raises for
    an unknown keyword.
    """
    if options is None:
        options = PipelineOptions()
    fields = {f.name for f in dataclasses.fields(PipelineOptions)}
    unknown = sorted(k for k in keywords if k != "stages" and k not in fields)
    if unknown:
        raise TypeError(f"{where}() got an unexpected keyword argument {unknown[0]!r}")
    moved = {k: v for k, v in keywords.items() if k in fields}
    if "stages" in keywords:
        if ranks is not None:
            raise TypeError(f"{where}() takes ranks= or the deprecated stages=, not both")
        ranks = keywords["stages"]
    if keywords:
        spelled = ", ".join(f"{k}={v!r}" for k, v in moved.items())
        new = [f"ranks={ranks!r}"] if "stages" in keywords else []
        new += [f"options=memfit.pipeline.PipelineOptions({spelled})"] if moved else []
        warnings.warn(
            f"{where}({', '.join(f'{k}=...' for k in keywords)}) is deprecated and will be "
            f"removed in the next release: write {where}(model, example_inputs, ..., "
            f"{', '.join(new)})"
            + (" (stages= counted ranks, one device each)" if "stages" in keywords else ""),
            DeprecationWarning,
            stacklevel=3,
        )
    if ranks is None:
        raise TypeError(f"{where}() needs ranks=K, the number of ranks (one device each)")
    return ranks, dataclasses.replace(options, **moved) if moved else options
