"""``schedule="auto"``: every configuration torch's rules allow compared, the fastest that fits
kept, and a budget nothing fits refused with the least reachable per-device peak."""

from __future__ import annotations

import pytest

import memfit
from memfit.pipeline import PipelineOptions, PipelineSchedule, plan
from memfit.pipeline.auto import configurations, microbatch_counts
from memfit.pipeline.schedule import check_schedule
from pipeline_models import build


def test_micro_batch_counts_divide_the_batch_near_k_2k_4k_and_8k() -> None:
    assert microbatch_counts(64, 2) == [2, 4, 8, 16]
    assert microbatch_counts(6, 4) == [3, 6]  # the largest divisor at or below each target
    assert microbatch_counts(7, 2) == [1, 7]
    assert all(64 % m == 0 for m in microbatch_counts(64, 3))


def test_configurations_are_those_torch_runs() -> None:
    found = list(configurations(2, [2, 4], None))
    for schedule, v, m in found:
        check_schedule(schedule, 2, m, v)  # raises for anything torch would refuse
    assert (PipelineSchedule.ONE_F_ONE_B, 1, 2) in found
    assert (PipelineSchedule.DUALPIPEV, 2, 2) not in found  # DualPipeV needs M >= 2K
    assert (PipelineSchedule.DUALPIPEV, 2, 4) in found
    assert {v for s, v, _ in found if s is PipelineSchedule.LOOPED_BFS} == {2, 4}
    assert {s for s, _, _ in found} == set(PipelineSchedule)
    only_two = list(configurations(2, [4], 2))
    assert only_two and all(v == 2 for _, v, _ in only_two)


@pytest.mark.slow
def test_auto_keeps_the_least_predicted_step_and_prints_the_candidates() -> None:
    model, x, target, loss_fn = build("mlp")
    chosen = plan(
        model, x, loss_fn, ranks=2, options=PipelineOptions(microbatches=4, schedule="auto")
    )
    fitting = [c for c in chosen.candidates if c.fits]
    assert len(fitting) == len(chosen.candidates) >= 7  # no budget: every one fits
    (best,) = (c for c in chosen.candidates if c.chosen)
    assert best.step_seconds == min(c.step_seconds or 0 for c in fitting)
    assert (chosen.schedule, chosen.stages_per_rank, chosen.microbatches) == (
        best.schedule,
        best.stages_per_rank,
        best.microbatches,
    )
    assert chosen.step_seconds == pytest.approx(best.step_seconds)
    assert len(chosen.stages) == 2 * chosen.stages_per_rank
    text = str(chosen)
    assert "schedule='auto' compared" in text and "dualpipev" in text and "\n* " in text


@pytest.mark.slow
def test_auto_under_a_budget_fits_it_or_names_the_least_reachable_peak() -> None:
    model, x, target, loss_fn = build("wide")
    free = plan(
        model, x, loss_fn, ranks=2, options=PipelineOptions(microbatches=4, schedule="auto")
    )
    peaks = sorted(c.peak_bytes or 0 for c in free.candidates)
    budget = peaks[len(peaks) // 2]  # half the configurations kept everything above it
    tight = plan(
        model,
        x,
        loss_fn,
        ranks=2,
        options=PipelineOptions(microbatches=4, schedule="auto", budget=budget),
    )
    assert tight.peak_bytes <= budget and max(tight.rank_peaks) <= budget
    fits = [c for c in tight.candidates if c.fits]
    assert fits and all((c.peak_bytes or 0) <= budget for c in fits)
    assert all((c.peak_bytes or 0) > budget for c in tight.candidates if not c.fits)
    with pytest.raises(memfit.BudgetError, match="least reachable per-device peak") as info:
        plan(
            model,
            x,
            loss_fn,
            ranks=2,
            options=PipelineOptions(microbatches=4, schedule="auto", budget=1000),
        )
    least = info.value.least_bytes
    assert least is not None and least > 1000
    assert "refused" in str(info.value)


def test_auto_arguments_are_checked_before_anything_runs() -> None:
    model, x, target, loss_fn = build("mlp")
    with pytest.raises(ValueError, match="microbatches must be a positive integer"):
        plan(model, x, loss_fn, ranks=2, options=PipelineOptions(microbatches=0, schedule="auto"))
    with pytest.raises(ValueError, match="stages_per_rank must be a positive integer"):
        plan(
            model, x, loss_fn, ranks=2, options=PipelineOptions(schedule="auto", stages_per_rank=0)
        )


@pytest.mark.slow
def test_a_costly_action_makes_auto_choose_the_fewest() -> None:
    """With each forward and backward costing the runtime a second, the step is its actions:
    one stage per rank and the fewest micro-batches."""
    model, x, target, loss_fn = build("mlp")
    chosen = plan(
        model, x, loss_fn, ranks=2, options=PipelineOptions(schedule="auto", overhead=1.0)
    )
    assert chosen.stages_per_rank == 1
    assert chosen.microbatches == min(microbatch_counts(x.shape[0], 2))
