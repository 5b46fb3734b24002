"""``memfit.pipeline.stage_planner``: memfit's plans of a rank's stages, chosen together so the
rank fits the per-device budget with the least added time."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import pytest

import memfit.pipeline.stage_planner as stage_planner
from memfit.pipeline import PipelineOptions
from memfit.pipeline.costs import prepare_search
from memfit.pipeline.cut_search import choose_cuts
from memfit.pipeline.partition import split_stages
from memfit.pipeline.pipeline_options import configure, microbatch
from memfit.pipeline.stage_planner import (
    StageRefused,
    plan_rank,
    predicted_rank_peak,
    stage_facts,
)
from memfit.pipeline.stages import stage_inputs
from pipeline_models import build


@functools.cache
def _rank_zero(schedule: str, name: str = "gpt") -> tuple:
    """A model over 2 ranks, 4 micro-batches, cut for time: rank 0's stage facts, the options
    (no budget) and the search."""
    model, x, target, loss_fn = build(name)
    options = configure(2, PipelineOptions(microbatches=4, schedule=schedule, budget=None))
    micro = microbatch((x,), 4)
    search = prepare_search(model, micro, 128)
    graphs = split_stages(search.captured, choose_cuts(search, options))
    examples = stage_inputs(graphs, micro, search.captured)
    ranks = [0, 3] if schedule == "dualpipev" else [0]
    facts = [stage_facts(search, graphs[s], examples[s], options) for s in ranks]
    return facts, options, search


def _peak(search, facts: list, points: tuple, options) -> int:
    """The rank's peak were its stages to keep ``points`` (what the planner compares with the
    budget; every combination of points is compared here)."""
    return predicted_rank_peak(search, facts, points, options)


def test_one_stage_per_rank_keeps_the_cheapest_point_that_fits() -> None:
    facts, free_options, search = _rank_zero("1f1b")
    peaks = sorted(_peak(search, facts, (p,), free_options) for p in facts[0].frontier)
    budget = peaks[len(peaks) // 2]
    options = _with(free_options, budget=budget)
    (planned,) = plan_rank(search, facts, options).values()
    fitting = [p for p in facts[0].frontier if _peak(search, facts, (p,), options) <= budget]
    cheapest = min(p.cost_seconds for p in fitting)
    assert planned.budget_bytes in {p.peak_bytes for p in fitting if p.cost_seconds == cheapest}
    with pytest.raises(StageRefused) as info:
        plan_rank(search, facts, _with(options, budget=peaks[0] - 1))
    assert info.value.error.least_bytes == peaks[0]


def _with(options, **changes):
    return dataclasses.replace(options, **changes)


@pytest.mark.slow
@pytest.mark.parametrize("exhaustive", [True, False], ids=["every-combination", "greedy"])
def test_a_rank_of_two_stages_fits_the_budget_together(
    monkeypatch: pytest.MonkeyPatch, exhaustive: bool
) -> None:
    """DualPipeV's rank 0 (stages 0 and 3): at every budget between the least and the largest
    peak, the points chosen together fit; trying every combination, with the least added time
    of all (the greedy walk, past ``EXHAUSTIVE`` combinations, only fits)."""
    if not exhaustive:
        monkeypatch.setattr(stage_planner, "EXHAUSTIVE", 0)
    facts, free_options, search = _rank_zero("dualpipev")
    combos = list(itertools.product(*(f.frontier for f in facts)))
    peaks = sorted({_peak(search, facts, c, free_options) for c in combos})
    for budget in peaks:
        options = _with(free_options, budget=budget)
        plans = plan_rank(search, facts, options)
        assert sorted(plans) == [0, 3]
        chosen = tuple(
            next(p for p in f.frontier if p.peak_bytes == plans[f.graph.index].budget_bytes)
            for f in facts
        )
        assert _peak(search, facts, chosen, options) <= budget
        if exhaustive:
            fitting = [c for c in combos if _peak(search, facts, c, options) <= budget]
            least = min(sum(p.cost_seconds for p in c) for c in fitting)
            assert sum(p.cost_seconds for p in chosen) == pytest.approx(least)
    with pytest.raises(StageRefused) as info:
        plan_rank(search, facts, _with(free_options, budget=peaks[0] - 1))
    assert info.value.stage in (0, 3) and info.value.error.least_bytes == peaks[0]


def test_a_stage_offloads_where_only_an_offload_point_fits() -> None:
    """Below the least peak recomputation reaches only a point that offloads what the
    micro-batch keeps fits; its bytes offloaded and stall are the stage's. (The point is made
    here from the least recompute-only one: which offload points memfit's planner finds depends
    on the link it measures and its time limit, not on the pipeline.)"""
    facts, free_options, search = _rank_zero("1f1b", "wide")
    (stage,) = facts
    smallest = min(stage.frontier, key=lambda p: p.peak_bytes)
    moved = smallest.kept_bytes // 2
    offloading = dataclasses.replace(
        smallest,
        peak_bytes=smallest.peak_bytes - moved,
        kept_bytes=smallest.kept_bytes - moved,
        offloaded_bytes=moved,
        stall_seconds=1e-3,
    )
    with_offload = dataclasses.replace(stage, frontier=(offloading, *stage.frontier))
    budget = min(_peak(search, facts, (p,), free_options) for p in stage.frontier) - 1
    options = _with(free_options, budget=budget)
    assert _peak(search, [with_offload], (offloading,), options) <= budget
    (planned,) = plan_rank(search, [with_offload], options, exact=False).values()
    assert planned.offloaded_bytes == moved and planned.stall_seconds == 1e-3
    assert planned.kept_bytes == offloading.kept_bytes
    assert planned.time_seconds >= 3 * planned.forward_seconds + planned.stall_seconds
    assert planned.held_bytes + planned.step_peak_bytes <= budget
    with pytest.raises(StageRefused):
        plan_rank(search, facts, options, exact=False)  # without it, nothing fits
