"""Pipeline schedules: what each one makes a stage hold, its bubble, and its rules.

A schedule decides the order in which a stage runs its micro-batches' forwards and backwards,
so how many micro-batches' activations it holds at once ("in flight"), and, as torch runs it,
which earlier outputs and input gradients its send handles still hold beside a backward
(``held_at_backward``): that, not the stage's compute, is where schedules differ in memory.
GPipe and 1F1B take the same step, ``(M - 1) * slowest stage + sum of stages``
(``balancing.pipeline_step_time``), so the same bubble; they differ in what a stage holds and in
what they need (1F1B needs ``M >= K``).

The other schedules ``torch.distributed.pipelining`` offers run several stages per rank
(``placement`` says which rank holds which): interleaved and looped ones stage ``s`` on rank
``s % K``, V-shaped ones stages ``r`` and ``2K - 1 - r`` on rank ``r``. Here each of their stages
gets GPipe's model (every micro-batch in flight, every send held: a bound per stage); a rank's
peak is simulated on the order torch runs its stages in (``rank_model``), and a budget is met by
the rank's stages together (``stage_planner``).

``PipelineSchedule`` is the closed choice; every public function takes a member or its string
and converts at the boundary (``as_schedule``), naming the choices when the string is none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from memfit.choice import Choice
from memfit.pipeline.balancing import pipeline_step_time

__all__ = [
    "SCHEDULES",
    "HeldAtBackward",
    "PipelineSchedule",
    "as_schedule",
    "bubble",
    "check_schedule",
    "default_stages_per_rank",
    "equal_stages_bubble",
    "held_at_backward",
    "in_flight",
    "is_single",
    "is_v_shaped",
    "splits_backward",
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
    #: 1F1B over several stages per rank (``ScheduleInterleaved1F1B``, Megatron's interleaving),
    #: stage ``s`` on rank ``s % K``, earlier micro-batches first ("depth first"); needs ``M`` a
    #: multiple of its rounds, ``max(1, M // K)``
    INTERLEAVED_1F1B = "interleaved_1f1b"
    #: every micro-batch through a rank's earlier stage before its later one ("breadth first",
    #: ``ScheduleLoopedBFS``), stage ``s`` on rank ``s % K``
    LOOPED_BFS = "looped_bfs"
    #: interleaved 1F1B whose backwards are split into input and weight gradients, the weight
    #: gradients deferred into the bubble (``ScheduleInterleavedZeroBubble``, ZB-1P); ``M`` a
    #: multiple of its rounds, as interleaved 1F1B
    INTERLEAVED_ZERO_BUBBLE = "interleaved_zero_bubble"
    #: zero bubble on a V (``ScheduleZBVZeroBubble``): rank ``r`` holds stages ``r`` and
    #: ``2K - 1 - r``; needs ``M >= 2K - 1``
    ZBV_ZERO_BUBBLE = "zbv_zero_bubble"
    #: DeepSeek's DualPipe on a V (``ScheduleDualPipeV``): one micro-batch's forward beside
    #: another's backward; rank ``r`` holds stages ``r`` and ``2K - 1 - r``; needs ``M >= 2K``
    DUALPIPEV = "dualpipev"


#: The schedules' names, as ``schedule=`` and ``--schedule`` accept them.
SCHEDULES = PipelineSchedule.values()


def as_schedule(schedule: PipelineSchedule | str) -> PipelineSchedule:
    """``schedule`` as a member (a name in any case, spaces around it ignored); a
    ``ValueError`` naming the choices when it is none."""
    name = schedule.strip().lower() if isinstance(schedule, str) else schedule
    return PipelineSchedule.parse(name, "schedule", "memfit.pipeline.PipelineSchedule")


#: One stage per rank.
_SINGLE = frozenset({PipelineSchedule.GPIPE, PipelineSchedule.ONE_F_ONE_B})
#: Two stages per rank, in a V.
_V_SHAPED = frozenset({PipelineSchedule.ZBV_ZERO_BUBBLE, PipelineSchedule.DUALPIPEV})
#: Interleaved: ``M`` a multiple of the rounds.
_ROUNDS = frozenset({PipelineSchedule.INTERLEAVED_1F1B, PipelineSchedule.INTERLEAVED_ZERO_BUBBLE})


def is_single(schedule: PipelineSchedule | str) -> bool:
    """Whether the schedule runs one stage per rank (GPipe, 1F1B)."""
    return as_schedule(schedule) in _SINGLE


def is_v_shaped(schedule: PipelineSchedule | str) -> bool:
    """Whether rank ``r`` holds stages ``r`` and ``2K - 1 - r`` (else stage ``s`` is on rank
    ``s % K``)."""
    return as_schedule(schedule) in _V_SHAPED


def splits_backward(schedule: PipelineSchedule | str) -> bool:
    """Whether the schedule runs input and weight gradients as separate steps (zero bubble)."""
    return as_schedule(schedule) in {
        PipelineSchedule.INTERLEAVED_ZERO_BUBBLE,
        PipelineSchedule.ZBV_ZERO_BUBBLE,
        PipelineSchedule.DUALPIPEV,
    }


def default_stages_per_rank(schedule: PipelineSchedule | str) -> int:
    """One for GPipe and 1F1B, two for the schedules that run several stages per rank."""
    return 1 if as_schedule(schedule) in _SINGLE else 2


def check_schedule(
    schedule: PipelineSchedule | str, ranks: int, microbatches: int, stages_per_rank: int = 1
) -> None:
    """Raise ``ValueError`` when ``schedule`` cannot run ``stages_per_rank`` stages on each of
    K = ``ranks`` ranks with ``microbatches`` micro-batches (torch 2.13's rules, checked before
    anything runs)."""
    chosen = as_schedule(schedule)
    v = stages_per_rank
    if not isinstance(v, int) or v < 1:
        raise ValueError(f"stages_per_rank must be a positive integer, got {v!r}")
    if chosen in _SINGLE and v != 1:
        raise ValueError(
            f"{chosen} runs one stage per rank, got stages_per_rank={v}; use "
            "schedule='interleaved_1f1b' or 'looped_bfs' for several"
        )
    if chosen in _V_SHAPED and v != 2:
        raise ValueError(f"{chosen} runs exactly two stages per rank (a V), got {v}")
    if chosen is PipelineSchedule.ONE_F_ONE_B and microbatches < ranks:
        raise ValueError(
            f"1F1B needs at least as many micro-batches as stages ({microbatches} < {ranks}); "
            "use more micro-batches or schedule='gpipe'"
        )
    rounds = max(1, microbatches // ranks)
    if chosen in _ROUNDS and microbatches % rounds:
        raise ValueError(
            f"{chosen} needs the micro-batches to be a multiple of its rounds, max(1, M // K) = "
            f"{rounds} (M = {microbatches}, K = {ranks}); use M = {rounds * ranks}"
        )
    least = {PipelineSchedule.ZBV_ZERO_BUBBLE: 2 * ranks - 1, PipelineSchedule.DUALPIPEV: 2 * ranks}
    if chosen in least and microbatches < least[chosen]:
        raise ValueError(
            f"{chosen} on {ranks} ranks needs at least {least[chosen]} micro-batches, got "
            f"{microbatches}"
        )


def in_flight(schedule: PipelineSchedule | str, stage: int, stages: int, microbatches: int) -> int:
    """Micro-batches stage ``stage`` holds at once: all under GPipe, ``K - s`` under 1F1B;
    every one under the schedules with several stages per rank (an upper bound, see the module
    docstring)."""
    if as_schedule(schedule) is not PipelineSchedule.ONE_F_ONE_B:
        return microbatches
    return min(microbatches, stages - stage)


@dataclass(frozen=True)
class HeldAtBackward:
    """What a stage holds beside one micro-batch's backward, in micro-batches (NOTE [What
    torch's schedules hold beside a backward])."""

    #: other micro-batches whose forward has run and whose backward has not
    in_flight: int
    #: earlier micro-batches' outputs, past their own backward, that a send handle still holds
    sends: int
    #: earlier micro-batches' input gradients that a send handle still holds
    input_grads: int
    #: whether the parameters' gradients exist already (from the second backward on)
    grads: bool


# NOTE [What torch's schedules hold beside a backward]
# Checked on torch 2.13, ``torch/distributed/pipelining/schedules.py``; stage ``s`` of ``K``,
# ``M`` micro-batches, backward ``j`` (0-based):
# * ``ScheduleGPipe._step_microbatches`` runs every forward, then every backward; it keeps every
#   forward send's handle in ``fwd_sends_to_wait`` and every backward send's in
#   ``bwd_sends_to_wait`` until the step ends, and a handle holds its tensor. So beside backward
#   ``j``: ``M - 1 - j`` others in flight, the outputs of the ``j`` micro-batches before (not on
#   the last stage, which sends nothing) and their ``j`` input gradients (not on the first,
#   whose inputs need none).
# * ``Schedule1F1B._step_microbatches`` runs ``W = min(M, K - s)`` warm-up forwards, then
#   backward ``j`` followed by forward ``j + W`` while forwards remain, then the remaining
#   backwards: ``min(W, M - j) - 1`` others in flight. Its warm-up fires every forward send but
#   the last and keeps the latest fired one's handle (``send_work``, micro-batch ``W - 2``) until
#   the steady loop ends after backward ``M - W``: that output outlives its own backward during
#   backwards ``W - 1 .. M - W``. Each backward's send (``bwd_sends``, then ``send_work`` in the
#   cool-down) is held until the next backward has run: from backward 1 on, the previous
#   micro-batch's input gradient.
# * Both: parameter gradients exist from the second backward on (``.grad`` is None before a
#   step), and the stage's receive buffers (``M`` inputs, ``M`` output gradients) live between
#   steps (``StagePlan.buffers_bytes``).
# ``Pipeline`` asks the schedule not to keep the last stage's outputs for merging
# (``return_outputs=False``), so those are held only while in flight.


def held_at_backward(
    schedule: PipelineSchedule | str, stage: int, stages: int, microbatches: int, backward: int
) -> HeldAtBackward:
    """What stage ``stage`` holds beside micro-batch ``backward``'s backward (its ``j``-th)."""
    first, last = stage == 0, stage == stages - 1
    j, m = backward, microbatches
    if as_schedule(schedule) is not PipelineSchedule.ONE_F_ONE_B:  # GPipe's, or its bound
        return HeldAtBackward(
            in_flight=m - 1 - j,
            sends=0 if last else j,
            input_grads=0 if first else j,
            grads=j > 0,
        )
    warmup = min(m, stages - stage)
    return HeldAtBackward(
        in_flight=min(warmup, m - j) - 1,
        sends=int(not last and warmup - 1 <= j <= m - warmup),
        input_grads=int(not first and j > 0),
        grads=j > 0,
    )


def step_peak(
    schedule: PipelineSchedule | str,
    stage: int,
    stages: int,
    microbatches: int,
    *,
    each: int,
    transient: int,
    grads: int,
    sent: int = 0,
    input_grad: int = 0,
) -> int:
    """A stage's peak during a step above what is live before it: the largest of its backwards
    (``StagePlan.step_peak_bytes`` says why each term is there).

    ``transient``: one micro-batch's forward and backward, its parameter gradients included;
    ``each``: what every other micro-batch in flight holds meanwhile; ``grads``: the gradients
    accumulated so far; ``sent``: one micro-batch's outputs, ``input_grad``: its input
    gradients, as send handles hold them (``held_at_backward``).
    """
    peak = 0
    for j in range(microbatches):
        held = held_at_backward(schedule, stage, stages, microbatches, j)
        peak = max(
            peak,
            held.in_flight * each
            + transient
            + (grads if held.grads else 0)
            + held.sends * sent
            + held.input_grads * input_grad,
        )
    return peak


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
