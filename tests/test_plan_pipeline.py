"""``memfit.pipeline.plan``: the cut, each stage's plan and prediction, errors before any run."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

import memfit
from memfit.pipeline import PipelineOptions, PipelineSchedule, plan
from memfit.pipeline.pipeline_options import configure
from memfit.pipeline.schedule import in_flight
from pipeline_models import build


def test_a_plan_has_k_contiguous_stages_covering_the_graph_and_prints_a_table() -> None:
    model, x, target, loss_fn = build("skip")
    before = {n: t.clone() for n, t in model.state_dict().items()}
    planned = plan(model, x, loss_fn, ranks=3, options=PipelineOptions(microbatches=4))
    assert len(planned.stages) == 3
    assert planned.stages[0].start == 0
    for a, b in zip(planned.stages, planned.stages[1:]):
        assert a.end == b.start
    assert [s.start for s in planned.stages[1:]] == list(planned.cuts)
    assert planned.stages[0].first_module == "inp" and planned.stages[-1].last_module == "out"
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())  # unchanged
    text = str(planned)
    assert "3 stages, 4 micro-batches" in text and "bubble" in text
    times = [s.time_seconds for s in planned.stages]
    assert planned.step_seconds == pytest.approx(3 * max(times) + sum(times))


def test_in_flight_micro_batches_follow_the_schedule() -> None:
    assert [in_flight("gpipe", s, 4, 8) for s in range(4)] == [8, 8, 8, 8]
    assert [in_flight("1f1b", s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    model, x, target, loss_fn = build("mlp")
    planned = plan(
        model, x, loss_fn, ranks=2, options=PipelineOptions(microbatches=4, schedule="1f1b")
    )
    assert [s.in_flight for s in planned.stages] == [2, 1]
    # beside a steady-state backward torch's Schedule1F1B also holds, on the first stage, the
    # output of micro-batch 0 (the warm-up's last fired send handle) and, on the last, the
    # previous micro-batch's input gradient (its backward send handle)
    first, last = planned.stages
    assert last.receive_grad_bytes == last.receive_bytes > 0 and first.receive_grad_bytes == 0
    each = first.kept_bytes + first.send_bytes
    held = first.send_bytes
    assert first.step_peak_bytes == each + first.transient_bytes + first.parameter_bytes + held
    held = last.receive_grad_bytes
    assert last.step_peak_bytes == last.transient_bytes + last.parameter_bytes + held
    assert planned.schedule is PipelineSchedule.ONE_F_ONE_B and "1f1b" in str(planned)
    assert all(s.schedule is PipelineSchedule.ONE_F_ONE_B for s in planned.stages)
    by_member = plan(
        model,
        x,
        loss_fn,
        ranks=2,
        options=PipelineOptions(microbatches=4, schedule=PipelineSchedule.GPIPE),
    )
    assert [s.in_flight for s in by_member.stages] == [4, 4]


def test_schedules_with_several_stages_per_rank_cut_that_many_stages_and_place_them() -> None:
    model, x, target, loss_fn = build("skip")
    planned = plan(
        model, x, loss_fn, ranks=2, options=PipelineOptions(microbatches=4, schedule="dualpipev")
    )
    assert len(planned.stages) == 4 and planned.stages_per_rank == 2
    assert [s.rank for s in planned.stages] == [0, 1, 1, 0]
    assert planned.stages[0].start == 0 and planned.stages[-1].last_module == "out"
    for a, b in zip(planned.stages, planned.stages[1:]):
        assert a.end == b.start
    # each rank's peak is simulated on the schedule's order, below the sum of its stages'
    # GPipe bounds
    by_rank = [sum(s.peak_bytes for s in planned.stages if s.rank == r) for r in (0, 1)]
    assert planned.peak_bytes == max(planned.rank_peaks)
    assert all(p <= bound for p, bound in zip(planned.rank_peaks, by_rank))
    assert [s.index for s in planned.rank_stages(1)] == [1, 2]
    assert "rank peaks" in str(planned)
    # the step is simulated on the schedule's order: no shorter than the busiest rank's work
    work = [4 * sum(s.time_seconds for s in planned.rank_stages(r)) for r in (0, 1)]
    assert planned.step_seconds >= max(work) * (1 - 1e-9)
    assert 0 <= planned.bubble < 1
    assert "4 stages (2 per rank on 2 ranks)" in str(planned)
    three = plan(
        model,
        x,
        loss_fn,
        ranks=2,
        options=PipelineOptions(microbatches=4, schedule="looped_bfs", stages_per_rank=3),
    )
    assert [s.rank for s in three.stages] == [0, 1, 0, 1, 0, 1]


def test_a_budget_is_met_by_every_stage_or_refused_with_the_least_that_fits() -> None:
    model, x, target, loss_fn = build("skip")
    free = plan(model, x, loss_fn, ranks=2, options=PipelineOptions(microbatches=4))
    budget = int(0.9 * free.peak_bytes)
    try:
        tight = plan(
            model, x, loss_fn, ranks=2, options=PipelineOptions(microbatches=4, budget=budget)
        )
    except memfit.BudgetError as err:
        assert err.least_bytes is not None and err.least_bytes > budget
    else:
        assert tight.peak_bytes <= budget
    with pytest.raises(memfit.BudgetError, match="smallest per-device budget") as info:
        plan(model, x, loss_fn, ranks=2, options=PipelineOptions(microbatches=4, budget=1000))
    smallest = info.value.least_bytes
    assert smallest is not None and smallest > 1000


@pytest.mark.parametrize(
    ("ranks", "options", "message"),
    [
        (100, PipelineOptions(microbatches=4), "candidate cuts"),
        (4, PipelineOptions(microbatches=2, schedule="1f1b"), "1F1B needs"),
        (2, PipelineOptions(microbatches=3), "multiple of 3"),
        (2, PipelineOptions(microbatches=4, budget=0.5), "bytes per device"),
        (2, PipelineOptions(microbatches=4, schedule="zb"), "schedule must be"),
        (0, PipelineOptions(microbatches=4), "ranks must be"),
        (2, PipelineOptions(schedule="1f1b"), "only schedule='auto' chooses it"),
        (2, PipelineOptions(microbatches=4, offload="yes"), "offload is True or False"),  # type: ignore[arg-type]
        (2, PipelineOptions(microbatches=2, schedule="dualpipev"), "at least 4"),
        (2, PipelineOptions(microbatches=4, stages_per_rank=2), "one stage per rank"),
    ],
)
def test_bad_options_are_refused_before_anything_runs(
    ranks: int, options: PipelineOptions, message: str
) -> None:
    model, x, target, loss_fn = build("mlp")
    with pytest.raises(ValueError, match=message):
        plan(model, x, loss_fn, ranks=ranks, options=options)


def test_the_keywords_of_0_1_still_plan_the_same_pipeline_with_a_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``stages=K`` (which counted ranks) and one keyword per option, until the next release:
    the search is asked the same configuration on the same micro-batch."""
    asked = []
    # the attribute memfit.pipeline.plan is the function
    module = importlib.import_module("memfit.pipeline.plan_pipeline")
    monkeypatch.setattr(module, "prepare_search", lambda model, micro, max_items: max_items)
    monkeypatch.setattr(
        module, "plan_from_search", lambda *args: asked.append((args[0], args[1][0], args[2]))
    )
    model, x, target, loss_fn = build("mlp")
    options = PipelineOptions(microbatches=4, schedule="1f1b", budget="1MiB", max_items=9)
    plan(model, x, loss_fn, ranks=2, options=options)
    with pytest.warns(DeprecationWarning, match=r"ranks=2, options=memfit\.pipeline") as caught:
        plan(
            model, x, loss_fn, stages=2, microbatches=4, schedule="1f1b", budget="1MiB", max_items=9
        )
    assert caught[0].filename == __file__  # the warning names the caller's line
    (new_items, new_micro, new), (old_items, old_micro, old) = asked
    assert (old_items, old) == (new_items, new) == (9, configure(2, options))
    assert torch.equal(old_micro, new_micro) and old_micro.shape[0] == x.shape[0] // 4


def test_the_loss_measured_on_the_last_stage_joins_its_micro_batch_peak() -> None:
    """The loss runs first in a micro-batch's backward, beside what the micro-batch keeps and
    its outputs: where that is more than the stage's own transient, it is the peak."""
    model, x, target, loss_fn = build("mlp")
    planned = plan(
        model, x, loss_fn, ranks=2, options=PipelineOptions(microbatches=4, schedule="1f1b")
    )
    last = planned.stages[-1]
    assert last.loss_bytes == 0 and last.micro_peak_bytes == last.transient_bytes
    big = dataclasses.replace(last, loss_bytes=10 * last.transient_bytes)
    assert big.micro_peak_bytes == big.kept_bytes + big.send_bytes + big.loss_bytes
    assert big.step_peak_bytes - last.step_peak_bytes == big.micro_peak_bytes - last.transient_bytes
    small = dataclasses.replace(last, loss_bytes=1)
    assert small.step_peak_bytes == last.step_peak_bytes


@pytest.mark.slow
def test_the_runtimes_overhead_and_the_links_latency_join_the_predicted_step() -> None:
    """Compared with the same plan without them (one profile: two plans' profiles, taken at
    different times on a loaded machine, differ by more than the overhead)."""
    model, x, target, loss_fn = build("mlp")
    options = PipelineOptions(microbatches=4, overhead=0.01, latency=0.002)
    slow = plan(model, x, loss_fn, ranks=2, options=options)
    assert (slow.overhead, slow.latency) == (0.01, 0.002)
    times = [s.time_seconds + 0.02 for s in slow.stages]
    assert slow.step_seconds == pytest.approx(3 * max(times) + sum(times) + 2 * 0.002)
    bare = dataclasses.replace(slow, overhead=0.0, latency=0.0)
    assert slow.bubble > bare.bubble  # the overhead is idle time
    interleaved = dataclasses.replace(options, schedule="interleaved_1f1b", latency=0.0)
    v_slow = plan(model, x, loss_fn, ranks=2, options=interleaved)
    v_bare = dataclasses.replace(v_slow, overhead=0.0)
    # every rank runs M x V forwards and backwards, each 10 ms longer
    assert v_slow.step_seconds >= v_bare.step_seconds + 2 * 4 * 2 * 0.01 - 1e-9
    with pytest.raises(ValueError, match="overhead is seconds >= 0"):
        plan(model, x, loss_fn, ranks=2, options=PipelineOptions(microbatches=4, overhead=-1.0))
