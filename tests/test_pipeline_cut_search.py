"""``memfit.pipeline.cut_search``: the one cut search ``plan`` and ``Pipeline`` run, and how it cuts
again around a span memfit's planner refuses (the planner is replaced here, to refuse at will)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest

import memfit
import memfit.pipeline.costs as costs
import memfit.pipeline.cut_search as search_module
from memfit.pipeline import PipelineOptions, plan
from memfit.pipeline.costs import prepare_search
from memfit.pipeline.cut_search import choose_cuts, search_stages
from memfit.pipeline.pipeline_options import configure, microbatch
from memfit.pipeline.stage_planner import StageRefused
from pipeline_models import build


def _refusing_first(monkeypatch: pytest.MonkeyPatch, stage: int) -> list[tuple[int, int, int]]:
    """Make memfit's planner refuse the first span proposed for ``stage``; returns the spans
    it was asked to plan."""
    real = search_module.plan_rank
    asked: list[tuple[int, int, int]] = []

    def planner(search: Any, facts: Any, options: Any, **kwargs: Any) -> Any:
        (graph,) = (f.graph for f in facts)  # one stage per rank under GPipe
        span = (graph.index, graph.start, graph.end)
        asked.append(span)
        if graph.index == stage and not any(a[0] == stage for a in asked[:-1]):
            error = memfit.BudgetError("refused by the test", budget_bytes=options.budget)
            raise StageRefused(graph.index, error)
        return real(search, facts, options, **kwargs)

    monkeypatch.setattr(search_module, "plan_rank", planner)
    return asked


def test_a_span_the_planner_refuses_is_cut_around(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x, target, loss_fn = build("skip")
    budget = (
        100 * plan(model, x, loss_fn, ranks=2, options=PipelineOptions(microbatches=4)).peak_bytes
    )
    asked = _refusing_first(monkeypatch, stage=0)
    planned = plan(
        model, x, loss_fn, ranks=2, options=PipelineOptions(microbatches=4, budget=budget)
    )
    refused = asked[0]
    assert refused[0] == 0 and len(asked) == 3  # refused, then both stages of a new split
    assert (0, planned.stages[0].start, planned.stages[0].end) != refused
    assert [(s.index, s.start, s.end) for s in planned.stages] == asked[1:]


def test_too_many_refusals_end_the_search(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x, target, loss_fn = build("skip")

    def planner(search: Any, facts: Any, options: Any, **kwargs: Any) -> Any:
        error = memfit.BudgetError("refused by the test", budget_bytes=options.budget)
        raise StageRefused(facts[0].graph.index, error)

    monkeypatch.setattr(search_module, "plan_rank", planner)
    with pytest.raises(memfit.BudgetError, match="refused by the test|planner could not fit"):
        plan(model, x, loss_fn, ranks=2, options=PipelineOptions(microbatches=4, budget=10**12))


def _skip_search() -> tuple[Any, Any, Any]:
    """The skip model under GPipe over 2 ranks, 4 micro-batches, a budget anything fits:
    the options, a micro-batch and the captured search."""
    model, x, target, loss_fn = build("skip")
    options = configure(2, PipelineOptions(microbatches=4, schedule="gpipe", budget=10**12))
    micro = microbatch((x,), 4)
    return options, micro, prepare_search(model, micro, 128)


def test_one_process_plans_its_stage_and_refuses_what_another_shares(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``Pipeline``'s use, in one process: plan stage 1 only; "another rank" refuses stage 0."""
    options, micro, search = _skip_search()
    shared: list[dict[int, memfit.BudgetError]] = []
    first_zero: list[tuple[int, int]] = []

    def share(failed: dict[int, memfit.BudgetError]) -> dict[int, memfit.BudgetError]:
        shared.append(dict(failed))
        if len(shared) > 1:
            return failed
        return {**failed, 0: memfit.BudgetError("stage 0 refused elsewhere", budget_bytes=None)}

    real_split = search_module.split_stages

    def split(captured: Any, cuts: Any) -> Any:
        graphs = real_split(captured, cuts)
        first_zero.append((graphs[0].start, graphs[0].end))
        return graphs

    monkeypatch.setattr(search_module, "split_stages", split)
    found = search_stages(search, micro, options, planned_here=[1], share=share)
    assert list(found.plans) == [1] and shared == [{}, {}]
    assert len(first_zero) == 2 and first_zero[1] != first_zero[0]
    assert found.plans[1].start == found.cuts[0] == first_zero[1][1]


def test_a_choice_that_ignores_refusals_ends_the_search(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``choose`` that proposes a refused split again (cuts forced by hand) gets an error,
    not a search that never ends."""
    options, micro, search = _skip_search()
    cut = search.costs.boundaries[1]

    def planner(search: Any, facts: Any, options: Any, **kwargs: Any) -> Any:
        error = memfit.BudgetError("refused by the test", budget_bytes=options.budget)
        raise StageRefused(facts[0].graph.index, error)

    monkeypatch.setattr(search_module, "plan_rank", planner)
    with pytest.raises(memfit.BudgetError, match="proposed again"):
        search_stages(search, micro, options, choose=lambda refused: [cut])


def _clock(nodes_per_run: int, slowed: set[int], runs: set[int]) -> SimpleNamespace:
    """A ``time`` whose ``perf_counter`` makes every node take 1 ms, and the nodes at positions
    ``slowed`` a second more in the runs ``runs`` (the profiler reads it at each node's start
    and end)."""
    reads = itertools.count()

    def perf_counter() -> float:
        k = next(reads)
        if k % 2 == 0:
            return 0.0
        run, node = divmod(k // 2, nodes_per_run)
        return 1e-3 + (1.0 if run in runs and node in slowed else 0.0)

    return SimpleNamespace(perf_counter=perf_counter)


def test_load_in_two_of_the_profiled_runs_leaves_the_cut_where_typical_times_put_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first layer is slowed by a second in the second and third profiled runs (a burst of
    load covers consecutive ops of one run): the cut is the one of the typical times, in the
    MLP's middle, not after the first layer."""
    model, x, target, loss_fn = build("mlp")
    micro = microbatch((x,), 4)
    config = configure(2, PipelineOptions(microbatches=4))
    nodes = list(prepare_search(model, micro, 64, repeats=1).captured.graph.graph.nodes)
    first_layer = {i for i, n in enumerate(nodes) if n.name in ("linear", "x")}
    assert len(first_layer) == 2
    monkeypatch.setattr(costs, "time", _clock(len(nodes), set(), set()))
    typical = choose_cuts(prepare_search(model, micro, 64), config)
    monkeypatch.setattr(costs, "time", _clock(len(nodes), first_layer, {1, 2}))
    loaded = prepare_search(model, micro, 64)
    assert choose_cuts(loaded, config) == typical
    assert loaded.costs.forward_seconds == pytest.approx([1e-3] * loaded.costs.count)
