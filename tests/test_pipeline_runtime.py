"""Pipelines on torch.distributed (gloo, one process per rank) against one process.

Each test starts real processes (a few seconds each on 2 cores), so every launch checks as much
as it can: GPipe's and 1F1B's gradients take three launches, the five schedules with several
stages per rank one (their gradients and each rank's measured peak), the peaks two more.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

import memfit
from memfit.pipeline import Pipeline, PipelineOptions, RankError, launch, plan
from memfit.pipeline.partition import capture_forward, split_stages
from memfit.pipeline.pipeline_options import microbatch
from memfit.pipeline.placement import stage_ranks
from memfit.pipeline.stages import rank_step_peak_bytes
from pipeline_models import build
from pipeline_workers import SEED, dies, forced_cuts, measured_peaks, train, trains_and_measures


def _plain_gradients(name: str, microbatches: int) -> dict[str, torch.Tensor]:
    """One process, plain PyTorch, the whole mini-batch: the mean loss's gradients."""
    model, x, target, loss_fn = build(name)
    loss_fn(model(x), target).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _stages_in_one_process(
    name: str, cuts: list[int], microbatches: int, ranks: tuple[int, ...] | None = None
) -> dict[str, object]:
    """The same stages run one after another in one process, each seeded as its rank is
    (``ranks``: the rank of each stage; by default stage s is on rank s)."""
    model, x, target, loss_fn = build(name)
    captured = capture_forward(model, microbatch((x,), microbatches))
    stages = split_stages(captured, cuts)
    values: list[tuple[torch.Tensor, ...]] = [(c,) for c in x.tensor_split(microbatches)]
    for s, stage in enumerate(stages):
        torch.manual_seed(SEED + (s if ranks is None else ranks[s]))
        values = [stage.module(*v) for v in values]
    losses = [
        loss_fn(captured.rebuild_output(v), t)
        for v, t in zip(values, target.tensor_split(microbatches))
    ]
    (sum(losses) / microbatches).backward()
    return {
        "grads": {n: p.grad for n, p in model.named_parameters()},
        "buffers": dict(model.named_buffers()),
        "loss": float(sum(losses) / microbatches),
    }


def _merged(results: list[dict]) -> dict[str, torch.Tensor]:
    grads: dict[str, torch.Tensor] = {}
    for r in results:
        for n, g in r["grads"].items():
            if n in grads:  # a tied parameter: every rank holding it has the summed gradient
                torch.testing.assert_close(g, grads[n], rtol=0, atol=0)
            grads[n] = g
    return grads


@pytest.mark.parametrize(("name", "stages"), [("mlp", 2), ("gpt", 2)])
def test_gradients_equal_plain_pytorch_on_the_mini_batch(name: str, stages: int) -> None:
    """GPipe and 1F1B (run one after the other in the same processes)."""
    results = launch(train, stages, args=(name, stages, 4), timeout=180)
    expected = _plain_gradients(name, 4)
    model, x, target, loss_fn = build(name)
    loss = float(loss_fn(model(x), target))
    for schedule in ("gpipe", "1f1b"):
        ranks = [r[schedule] for r in results]
        got = _merged(ranks)
        assert set(got) == set(expected)
        for n in expected:
            torch.testing.assert_close(got[n], expected[n], rtol=1e-5, atol=1e-6, msg=n)
        assert ranks[0]["loss"] == pytest.approx(loss, rel=1e-5)
        assert len({r["loss"] for r in ranks}) == 1  # every rank returns the same loss


def test_skip_batchnorm_and_dropout_across_stages_are_exact() -> None:
    """A value relayed through the middle stage; BatchNorm and dropout inside stages."""
    results = launch(train, 3, args=("skip", 3, 4), timeout=180)
    for schedule in ("gpipe", "1f1b"):
        ranks = [r[schedule] for r in results]
        cuts = [r["start"] for r in ranks[1:]]
        expected = _stages_in_one_process("skip", cuts, 4)
        got = _merged(ranks)
        for n, g in expected["grads"].items():  # type: ignore[union-attr]
            torch.testing.assert_close(got[n], g, rtol=1e-5, atol=1e-6, msg=n)
        buffers = {n: b for r in ranks for n, b in r["buffers"].items()}
        assert buffers  # the BatchNorm is in some stage
        for n, b in buffers.items():
            expected_buffer = expected["buffers"][n]  # type: ignore[index]
            torch.testing.assert_close(b, expected_buffer, rtol=1e-6, atol=0, msg=n)
        assert ranks[0]["loss"] == pytest.approx(expected["loss"], rel=1e-5)


#: TinyGPT cuts (graph nodes) the measured-peak test forces: where the search cut when the
#: machine was idle (57) and loaded (60); its own cut follows profiled times
GPT_CUTS = (57, 60)


#: the schedules that run several stages per rank
SEVERAL_PER_RANK = (
    "interleaved_1f1b",
    "looped_bfs",
    "interleaved_zero_bubble",
    "zbv_zero_bubble",
    "dualpipev",
)


#: the wide MLP's cuts (graph nodes) for four stages of two layers (the last with the head)
WIDE_CUTS = (4, 8, 12)
#: cuts of the wide MLP under a budget: four layers in the first stage, whose plans can trade
BUDGET_CUTS = (8, 12, 14)


def test_every_schedule_with_two_stages_per_rank_equals_one_process() -> None:
    """Two ranks, four stages (interleaved and looped: 0 and 2 on rank 0; V: 0 and 3), a value
    relayed across stages, BatchNorm and dropout inside them; all five schedules and the one
    ``"auto"`` chooses among them in one launch, which also measures each rank's peak on issue
    57's MLP against its prediction, and under a budget that makes interleaved 1F1B's first rank
    recompute (its stages planned together).

    Each stage draws from its own stream, started from its rank's generator, so the masks are
    those of the stages run one after another, each seeded as its rank is.
    """
    model, x, target, loss_fn = build("wide")
    with forced_cuts(BUDGET_CUTS):
        free = plan(
            model,
            x,
            loss_fn,
            ranks=2,
            options=PipelineOptions(microbatches=4, schedule="interleaved_1f1b"),
        )
        budget = int(0.9 * free.peak_bytes)
        tight = plan(
            model,
            x,
            loss_fn,
            ranks=2,
            options=PipelineOptions(microbatches=4, schedule="interleaved_1f1b", budget=budget),
        )
    torch.compiler.reset()
    assert max(tight.rank_peaks) <= budget
    assert sum(s.kept_bytes for s in tight.stages) < sum(s.kept_bytes for s in free.stages)
    budgeted = ("interleaved_1f1b", BUDGET_CUTS, budget)
    results = launch(
        trains_and_measures, 2, args=(SEVERAL_PER_RANK, WIDE_CUTS, budgeted), timeout=500
    )
    for schedule, ranks_peaks in zip(SEVERAL_PER_RANK, zip(*(r["peaks"] for r in results))):
        for rank, (_, measured, predicted) in enumerate(ranks_peaks):
            assert measured == pytest.approx(predicted, rel=0.10), (schedule, rank)
    for rank, (_, measured, predicted) in enumerate(r["budget"] for r in results):
        assert predicted == rank_step_peak_bytes(tight.rank_stages(rank), 2)
        assert measured == pytest.approx(predicted, rel=0.10), rank
        held = sum(s.held_bytes for s in tight.rank_stages(rank))
        # within the budget, to the rank model's accuracy (a measured step of 1.30 MB came
        # 0.4% above its prediction; NOTE [What torch's runtime schedules hold])
        assert held + measured <= budget * 1.01, rank
    for schedule in (*SEVERAL_PER_RANK, "auto"):
        ranks = [r["train"][schedule] for r in results]
        starts = {s: start for r in ranks for s, start in r["starts"].items()}
        assert sorted(starts) == [0, 1, 2, 3], schedule
        chosen = ranks[0]["schedule"]
        assert chosen in SEVERAL_PER_RANK and {r["schedule"] for r in ranks} == {chosen}
        placed = stage_ranks(chosen, 2, 2)
        assert all(s in r["starts"] for s in range(4) for r in [ranks[placed[s]]])
        cuts = [starts[s] for s in range(1, 4)]
        expected = _stages_in_one_process("skip", cuts, 4, placed)
        got = _merged(ranks)
        assert set(got) == set(expected["grads"])  # type: ignore[arg-type]
        for n, g in expected["grads"].items():  # type: ignore[union-attr]
            torch.testing.assert_close(got[n], g, rtol=1e-5, atol=1e-6, msg=f"{schedule} {n}")
        buffers = {n: b for r in ranks for n, b in r["buffers"].items()}
        assert buffers
        for n, b in buffers.items():
            expected_buffer = expected["buffers"][n]  # type: ignore[index]
            torch.testing.assert_close(b, expected_buffer, rtol=1e-6, atol=0, msg=n)
        assert ranks[0]["loss"] == pytest.approx(expected["loss"], rel=1e-5), schedule
        assert len({r["loss"] for r in ranks}) == 1


def test_measured_peak_of_each_stage_is_within_ten_percent_of_the_prediction() -> None:
    """At each forced cut, under a budget that makes the stages recompute (0.8 of that cut's
    free peak) and with none (every stage keeps everything, the last holding M micro-batches'
    losses under GPipe): measured within 10%, and within budget. One launch."""
    model, x, target, loss_fn = build("gpt")
    jobs = []
    for cut in GPT_CUTS:
        with forced_cuts((cut,)):
            free = plan(model, x, loss_fn, ranks=2, options=PipelineOptions(microbatches=4))
        torch.compiler.reset()
        jobs += [("gpipe", (cut,), int(0.8 * free.peak_bytes)), ("gpipe", (cut,), None)]
    results = launch(measured_peaks, 2, args=("gpt", 2, 4, tuple(jobs)), timeout=300)
    for (_, cuts, budget), ranks in zip(jobs, zip(*results)):
        for stage, measured, _ in ranks:
            assert stage.start in (0, cuts[0])
            assert measured == pytest.approx(stage.step_peak_bytes, rel=0.10), (budget, stage)
            if budget is not None:
                assert stage.peak_bytes <= budget
                held = stage.peak_bytes - stage.step_peak_bytes
                assert held + measured <= budget


def test_measured_peak_of_each_rank_is_its_prediction_under_1f1b_and_gpipe() -> None:
    """Issue 57's MLP (8 layers 64 wide, 1024 rows, 4 micro-batches of 64 KiB activations).

    Under 1F1B torch's send handles hold, beside a steady-state backward, an output the first
    rank's warm-up sent and the last rank's previous input gradient; GPipe's first backward,
    beside every other micro-batch, is its peak. Both schedules in one launch.
    """
    # cuts forced (graph nodes: 10 after layers.4, as in the issue; 4 after layers.1), as the
    # search's own follows profiled times: on a loaded machine it once cut after layers.0
    jobs = tuple((schedule, (cut,), None) for cut in (10, 4) for schedule in ("1f1b", "gpipe"))
    results = launch(measured_peaks, 2, args=("wide", 2, 4, jobs), timeout=300)
    for (schedule, _, _), ranks in zip(jobs, zip(*results)):
        for stage, measured, predicted in ranks:
            assert measured == pytest.approx(stage.step_peak_bytes, rel=0.03), (schedule, stage)
            assert predicted == stage.step_peak_bytes
            assert (stage.loss_bytes > 0) == stage.is_last  # measured at the first step


def test_a_killed_rank_ends_the_job_with_an_error_naming_it() -> None:
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(dies, 3, args=("mlp", 3), timeout=60)
    assert info.value.rank == 1
    assert "SIGKILL" in str(info.value)
    assert time.monotonic() - start < 60


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A process group of this process alone (no other process started)."""
    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
    )
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def _auto_pipeline() -> tuple[Pipeline, torch.Tensor, torch.Tensor]:
    torch.compiler.reset()
    model, x, target, loss_fn = build("mlp")
    options = PipelineOptions(microbatches=2, schedule="auto", stages_per_rank=1)
    return Pipeline(model, x, loss_fn, ranks=1, options=options), x, target


def _step(pipe: Pipeline, x: torch.Tensor, target: torch.Tensor) -> tuple[float, dict]:
    for p in pipe.parameters():
        p.grad = None
    loss = pipe.step(x, target=target).item()
    return loss, {n: p.grad.clone() for n, p in pipe.named_parameters()}


@pytest.mark.slow
def test_first_steps_inside_a_users_measurement_or_profiler_run_as_outside(one_rank: None) -> None:
    """The last stage measures its loss's memory at its first step; on CPU that is a profiler
    session, which cannot open inside ``memfit.measure`` or ``torch.profiler.profile``: it waits
    for a step outside them, and the steps inside run as they would outside."""
    outside, x, target = _auto_pipeline()
    expected = [_step(outside, x, target) for _ in range(2)]
    pipe, _, _ = _auto_pipeline()
    got = [memfit.measure(_step, pipe, x, target).result]
    with torch.profiler.profile():
        got.append(_step(pipe, x, target))
    for (loss, grads), (want_loss, want_grads) in zip(got, expected):
        assert loss == want_loss
        torch.testing.assert_close(grads, want_grads, rtol=0, atol=0)
    last = pipe.plans[-1]
    assert last.loss_bytes == 0  # not measured yet: every step so far ran inside a session
    _step(pipe, x, target)
    assert pipe.plans[-1].loss_bytes == outside.plans[-1].loss_bytes > 0
