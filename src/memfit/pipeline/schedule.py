"""Pipeline schedules: what each one makes a stage hold, its bubble, and its rules.

A schedule decides the order in which a stage runs its micro-batches' forwards and backwards,
so how many micro-batches' activations it holds at once ("in flight"): that, not the stage's
compute, is where schedules differ in memory. Both schedules here take the same step,
``(M - 1) * slowest stage + sum of stages`` (``balancing.pipeline_step_time``), so the same
bubble; they differ in what a stage holds and in what they need (1F1B needs ``M >= K``).

``PipelineSchedule`` is the closed choice; every public function takes a member or its string
and converts at the boundary (``as_schedule``), naming the choices when the string is none.
"""

from __future__ import annotations

from collections.abc import Sequence

from memfit.choice import Choice
from memfit.pipeline.balancing import pipeline_step_time

__all__ = [
    "SCHEDULES",
    "PipelineSchedule",
    "as_schedule",
    "bubble",
    "check_schedule",
    "equal_stages_bubble",
    "in_flight",
    "step_peak",
]


class PipelineSchedule(Choice):
    """The order in which each stage runs its micro-batches' forwards and backwards."""

    #: every micro-batch's forward, then every backward (``ScheduleGPipe``): a stage holds all
    #: ``M`` micro-batches in flight
    GPIPE = "gpipe"
    #: one forward, one backward (``Schedule1F1B``) after ``K - s`` forwards that fill the pipe:
    #: stage ``s`` holds at most ``K - s`` micro-batches; needs ``M >= K``
    ONE_F_ONE_B = "1f1b"


#: The schedules' names, as ``schedule=`` and ``--schedule`` accept them.
SCHEDULES = PipelineSchedule.values()


def as_schedule(schedule: PipelineSchedule | str) -> PipelineSchedule:
    """``schedule`` as a member (a name in any case, spaces around it ignored); a
    ``ValueError`` naming the choices when it is none."""
    name = schedule.strip().lower() if isinstance(schedule, str) else schedule
    return PipelineSchedule.parse(name, "schedule", "memfit.pipeline.PipelineSchedule")


def check_schedule(schedule: PipelineSchedule | str, stages: int, microbatches: int) -> None:
    """Raise ``ValueError`` when ``schedule`` cannot run ``stages`` stages on ``microbatches``."""
    if as_schedule(schedule) is PipelineSchedule.ONE_F_ONE_B and microbatches < stages:
        raise ValueError(
            f"1F1B needs at least as many micro-batches as stages ({microbatches} < {stages}); "
            "use more micro-batches or schedule='gpipe'"
        )


def in_flight(schedule: PipelineSchedule | str, stage: int, stages: int, microbatches: int) -> int:
    """Micro-batches stage ``stage`` holds at once: all under GPipe, ``K - s`` under 1F1B."""
    if as_schedule(schedule) is PipelineSchedule.GPIPE:
        return microbatches
    return min(microbatches, stages - stage)


def step_peak(
    schedule: PipelineSchedule | str,
    microbatches: int,
    flight: int,
    each: int,
    transient: int,
    grads: int,
) -> int:
    """A stage's peak during a step above what is live before it (``StagePlan.step_peak_bytes``
    says why each term is there).

    ``transient``: one micro-batch's forward and backward, its parameter gradients included;
    ``each``: what every other micro-batch in flight holds meanwhile; ``grads``: the gradients
    accumulated so far, alive from the second backward on.
    """
    if microbatches == 1:
        return transient
    if as_schedule(schedule) is PipelineSchedule.ONE_F_ONE_B and microbatches > flight:
        return (flight - 1) * each + transient + grads
    return (flight - 2) * each + transient + max(each, grads)


def bubble(stage_seconds: Sequence[float], microbatches: int) -> float:
    """Idle share of the devices' time over a step: ``1 - M * mean stage time / step``.

    The same under both schedules, which take the same step; for equal stages it is
    ``equal_stages_bubble``.
    """
    times = list(stage_seconds)
    step = pipeline_step_time(times, [1] * len(times), microbatches=microbatches)
    if step <= 0:
        return 0.0
    mean = sum(times) / len(times)
    return max(0.0, 1.0 - microbatches * mean / step)


def equal_stages_bubble(stages: int, microbatches: int) -> float:
    """The bubble of ``stages`` equal stages: ``(K - 1) / (M + K - 1)``."""
    return (stages - 1) / (microbatches + stages - 1)
