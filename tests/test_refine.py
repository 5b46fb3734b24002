"""The local search from the least peak: never worse, closed under what the backward needs, and
it finds real improvements where the segment programme's memory model misplaces checkpoints."""

from __future__ import annotations

import pytest
import torch

from memfit.analysis.simulate import simulate_step
from memfit.bench.graphs import joint_graphs
from memfit.bench.resnet import cifar_resnet
from memfit.planning.frontier import pareto_frontier
from memfit.planning.keep_rules import always_kept, keep_all
from memfit.planning.refine import refine_least_peak


def _resnet_graph():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    (jg,) = joint_graphs(cifar_resnet(3, 8), torch.randn(8, 3, 32, 32))
    return jg


def test_never_worse_and_closed_under_saved_needed() -> None:
    jg = _resnet_graph()
    start = keep_all(jg)
    kept, sim = refine_least_peak(jg, start)
    assert jg.saved_needed(kept) == kept
    assert sim.peak_bytes == simulate_step(jg, kept).peak_bytes
    assert sim.peak_bytes < simulate_step(jg, start).peak_bytes  # plain autograd is improvable
    fixed = always_kept(jg) & jg.saved_needed(start)
    assert fixed <= kept  # random ops' outputs and the step's outputs are never moved


@pytest.mark.slow
def test_every_single_move_from_its_answer_is_no_better() -> None:
    """A local minimum among the moves it tries: toggling any value of real size (1% of the
    largest storage) alive at the peak."""
    jg = _resnet_graph()
    kept, sim = refine_least_peak(jg, keep_all(jg), max_simulations=100_000)
    fixed = always_kept(jg)
    largest = max(jg.storage_bytes.values())
    for value in jg.forward:
        if not jg.is_tensor_value(value) or value.op == "placeholder" or value in fixed:
            continue
        if jg.bytes_of([value]) < 0.01 * largest:
            continue
        if not set(jg.storages[value]) & sim.peak_live:
            continue
        moved = kept - {value} if value in kept else kept | {value}
        assert simulate_step(jg, jg.saved_needed(moved)).peak_bytes >= sim.peak_bytes


@pytest.mark.slow
def test_frontier_lowest_point_is_refined() -> None:
    jg = _resnet_graph()
    points = pareto_frontier(jg)
    unrefined = [p for p in points if p.source != "refined"]
    assert points[0].peak_bytes <= min(p.peak_bytes for p in unrefined)
    again, _ = refine_least_peak(jg, set(points[0].kept))
    assert simulate_step(jg, again).peak_bytes == points[0].peak_bytes  # nothing left to find


def test_search_is_bounded_by_simulations_and_deterministic() -> None:
    jg = _resnet_graph()
    start = keep_all(jg)
    assert refine_least_peak(jg, start, max_simulations=0)[0] == jg.saved_needed(start)
    few = refine_least_peak(jg, start, max_simulations=5)[1].peak_bytes
    assert refine_least_peak(jg, start, max_simulations=5)[1].peak_bytes == few  # no clock in it
    assert refine_least_peak(jg, start, max_simulations=500)[1].peak_bytes <= few


def test_deadline_in_the_past_tries_no_move() -> None:
    jg = _resnet_graph()
    start = keep_all(jg)
    kept, _ = refine_least_peak(jg, start, deadline=0.0)
    assert kept == jg.saved_needed(start)
