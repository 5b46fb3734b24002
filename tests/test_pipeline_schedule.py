"""``memfit.pipeline.schedule``: the closed choice of schedule, what each makes a stage hold."""

from __future__ import annotations

import itertools

import pytest

from memfit.pipeline import PipelineSchedule
from memfit.pipeline.schedule import (
    SCHEDULES,
    as_schedule,
    bubble,
    check_schedule,
    equal_stages_bubble,
    in_flight,
    step_peak,
)


def test_a_schedule_is_a_member_or_its_name() -> None:
    assert SCHEDULES == ("gpipe", "1f1b")
    assert [s.value for s in PipelineSchedule] == list(SCHEDULES)
    assert PipelineSchedule.GPIPE == "gpipe" and f"{PipelineSchedule.ONE_F_ONE_B}" == "1f1b"
    assert str(PipelineSchedule.ONE_F_ONE_B) == "1f1b"
    assert as_schedule(PipelineSchedule.GPIPE) is PipelineSchedule.GPIPE
    assert as_schedule("gpipe") is PipelineSchedule.GPIPE
    assert as_schedule(" 1F1B ") is PipelineSchedule.ONE_F_ONE_B


@pytest.mark.parametrize("bad", ["zb", "", 3, None])
def test_an_unknown_schedule_is_refused_naming_the_choices(bad: object) -> None:
    with pytest.raises(ValueError, match=r"schedule must be one of \('gpipe', '1f1b'\)"):
        as_schedule(bad)  # type: ignore[arg-type]


def test_1f1b_needs_as_many_micro_batches_as_stages() -> None:
    with pytest.raises(ValueError, match=r"1F1B needs .* \(2 < 4\)"):
        check_schedule("1f1b", stages=4, microbatches=2)
    check_schedule(PipelineSchedule.ONE_F_ONE_B, stages=4, microbatches=4)
    check_schedule("gpipe", stages=4, microbatches=1)


def test_in_flight_is_every_micro_batch_under_gpipe_and_k_minus_s_under_1f1b() -> None:
    assert [in_flight(PipelineSchedule.GPIPE, s, 4, 8) for s in range(4)] == [8, 8, 8, 8]
    assert [in_flight(PipelineSchedule.ONE_F_ONE_B, s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1f1b", s, 4, 2) for s in range(4)] == [2, 2, 2, 1]


def _simulated_peak(
    schedule: str, microbatches: int, flight: int, each: int, t: int, g: int
) -> int:
    """The peak over the backwards of one stage's op order: F x flight, then (B, F) while
    forwards remain (1F1B; GPipe runs every F first), then the remaining B."""
    if schedule == "gpipe":
        order = ["F"] * microbatches + ["B"] * microbatches
    else:
        refills = microbatches - flight
        order = ["F"] * flight + ["B", "F"] * refills + ["B"] * flight
    held = backwards = peak = 0
    for op in order:
        if op == "F":
            held += 1
            continue
        peak = max(peak, (held - 1) * each + t + (g if backwards else 0))
        held -= 1
        backwards += 1
    return peak


def test_step_peak_is_the_largest_backward_of_the_schedules_op_order() -> None:
    assert step_peak("gpipe", 1, 1, 10, 7, 3) == 7
    assert step_peak("gpipe", 4, 4, 10, 7, 3) == 2 * 10 + 7 + 10
    assert step_peak("1f1b", 8, 2, 10, 7, 3) == 10 + 7 + 3
    for schedule, m, each, t, g in itertools.product(
        SCHEDULES, range(1, 7), (0, 5, 10), (1, 7), (0, 3, 20)
    ):
        flights = [m] if schedule == "gpipe" else range(1, m + 1)
        for f in flights:
            expected = _simulated_peak(schedule, m, f, each, t, g)
            assert step_peak(schedule, m, f, each, t, g) == expected, (schedule, m, f, each, g)


def test_the_bubble_of_equal_stages_is_k_minus_1_over_m_plus_k_minus_1() -> None:
    assert bubble([2.0] * 4, 8) == pytest.approx(equal_stages_bubble(4, 8)) == pytest.approx(3 / 11)
    assert bubble([1.0, 3.0], 4) == pytest.approx(1 - 4 * 2.0 / (3 * 3.0 + 4.0))
    assert bubble([0.0, 0.0], 4) == 0.0
