"""memfit.pipeline.pipeline_options: one options object, checked once; 0.1's keywords folded in."""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import pytest
import torch

from memfit.pipeline import PipelineOptions, PipelineSchedule
from memfit.pipeline.pipeline_options import configure, deprecated_keywords, microbatch


def test_configure_names_what_each_number_counts() -> None:
    config = configure(4, PipelineOptions(microbatches=8, schedule="interleaved_1f1b"))
    assert (config.ranks, config.stages_per_rank, config.stages) == (4, 2, 8)
    assert config.schedule is PipelineSchedule.INTERLEAVED_1F1B and config.budget is None
    one = configure(3, PipelineOptions(microbatches=4, budget="1KiB", overhead=1))
    assert (one.stages_per_rank, one.stages, one.budget, one.overhead) == (1, 3, 1024, 1.0)
    # under "auto" the schedule, stages per rank and micro-batches are placeholders auto replaces
    auto = configure(2, PipelineOptions(schedule="AUTO"))
    assert (auto.schedule, auto.stages_per_rank, auto.microbatches) == (
        PipelineSchedule.GPIPE,
        1,
        1,
    )


@pytest.mark.parametrize(
    ("ranks", "options", "message"),
    [
        (0, PipelineOptions(microbatches=4), "ranks must be a positive integer"),
        (2, PipelineOptions(), "microbatches must be a positive integer"),
        (2, PipelineOptions(microbatches=4, max_items=0), "max_items must be"),
        (2, PipelineOptions(microbatches=4, optimizer_state=-1), "optimizer_state must be"),
        (2, PipelineOptions(microbatches=4, latency=float("nan")), "latency is seconds"),
        (2, PipelineOptions(microbatches=4, budget=0.5), "not a fraction, got 0.5"),
    ],
)
def test_options_no_pipeline_can_honour_are_refused_with_the_value(
    ranks: int, options: PipelineOptions, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        configure(ranks, options)


def test_every_option_is_documented_where_it_is_declared() -> None:
    source = inspect.getsource(PipelineOptions).splitlines()
    for field in dataclasses.fields(PipelineOptions):
        at = next(i for i, line in enumerate(source) if line.strip().startswith(f"{field.name}:"))
        assert source[at - 1].strip().startswith("#:"), field.name


def test_the_old_keywords_become_options_with_one_warning_naming_the_new_spelling() -> None:
    base = PipelineOptions(budget="2GiB")
    with pytest.warns(DeprecationWarning) as caught:
        ranks, options = deprecated_keywords(
            "plan", None, base, {"stages": 4, "microbatches": 8, "offload": True}
        )
    assert (ranks, options) == (4, PipelineOptions(microbatches=8, budget="2GiB", offload=True))
    (warning,) = caught
    text = str(warning.message)
    assert "ranks=4" in text and "PipelineOptions(microbatches=8, offload=True)" in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spelling warns nothing
        assert deprecated_keywords("plan", 2, None, {}) == (2, PipelineOptions())
    with pytest.raises(TypeError, match="unexpected keyword argument 'stage'"):
        deprecated_keywords("plan", 2, None, {"stage": 2})
    with pytest.raises(TypeError, match="not both"):
        deprecated_keywords("plan", 2, None, {"stages": 2})
    with pytest.raises(TypeError, match="needs ranks=K"):
        deprecated_keywords("Pipeline", None, None, {})


def test_micro_batches_are_equal_chunks_of_every_input() -> None:
    a, b = torch.randn(8, 3), torch.randn(8, 5)
    first = microbatch((a, b, 7), 4)
    assert torch.equal(first[0], a[:2]) and torch.equal(first[1], b[:2]) and first[2] == 7
    with pytest.raises(ValueError, match="different batch sizes"):
        microbatch((a, torch.randn(6, 2)), 2)
    with pytest.raises(ValueError, match="multiple of 3"):
        microbatch((a,), 3)
