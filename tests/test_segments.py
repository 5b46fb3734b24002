"""The segment programme is exact within its model: checked against brute force on small graphs."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from memfit.bench.graphs import joint_graphs
from memfit.bench.zoo import cifar_resnet, tanh_chain
from memfit.planning.keep_rules import always_kept, keep_all
from memfit.planning.segments import SEGMENT_KINDS, SegmentModel


def _model(jg, **kw) -> SegmentModel:
    bw_read = {n for n in keep_all(jg) if n.op != "placeholder"}
    return SegmentModel(jg, always_kept(jg), bw_read, **kw)


def _brute_force(model: SegmentModel, budget: float) -> float:
    """Least cost over every segmentation and every mode per segment, same quantised model."""
    q, kept_b, trans_b = model.quantized()
    k = len(model.cuts)
    best = np.inf
    for mask in itertools.product((0, 1), repeat=k - 1):
        ends = [j + 1 for j, bit in enumerate(mask) if bit] + [k]
        starts = [0] + ends[:-1]
        for modes in itertools.product(range(len(SEGMENT_KINDS)), repeat=len(ends)):
            prefix, cost, ok = 0.0, 0.0, True
            for i, j, m in zip(starts, ends, modes):
                prefix += kept_b[m, i, j]
                if prefix + trans_b[m, i, j] > budget / q:
                    ok = False
                    break
                cost += model.secs[m, i, j]
            if ok:
                best = min(best, cost)
    return best


@pytest.fixture(scope="module")
def small_models():
    torch.compiler.reset()
    chain = joint_graphs(tanh_chain(6, width=32), torch.randn(32, 32, requires_grad=True))[0]
    resnet = joint_graphs(cifar_resnet(1), torch.randn(2, 3, 8, 8))[0]
    return [_model(chain, max_cuts=8), _model(resnet, max_cuts=6)]


def test_programme_equals_brute_force(small_models) -> None:
    for model in small_models:
        q, kept_b, _ = model.quantized()
        store_all = kept_b[0, 0, len(model.cuts)] * q
        for budget in np.linspace(0.05, 1.2, 12) * store_all:
            segments = model.solve(budget)
            expected = _brute_force(model, budget)
            if segments is None:
                assert expected == np.inf
                continue
            cost = sum(model.secs[m, i, j] for i, j, m in segments)
            assert cost == pytest.approx(expected, rel=1e-9, abs=1e-15)
            # segments tile the cuts in order
            assert segments[0][0] == 0 and segments[-1][1] == len(model.cuts)
            assert all(a[1] == b[0] for a, b in zip(segments, segments[1:]))


def test_storing_everything_keeps_what_autograd_keeps() -> None:
    torch.compiler.reset()
    jg = joint_graphs(cifar_resnet(1), torch.randn(2, 3, 8, 8))[0]
    model = _model(jg)
    segments = model.solve(float("inf"))
    assert segments is not None
    assert sum(model.secs[m, i, j] for i, j, m in segments) == 0
    kept = jg.saved_needed(model.kept_nodes(segments) | always_kept(jg))
    assert jg.bytes_of(kept) == jg.bytes_of(keep_all(jg))


def test_cuts_are_at_small_frontiers() -> None:
    """A ResNet's cuts fall where one tensor crosses (block boundaries), not inside blocks."""
    torch.compiler.reset()
    jg = joint_graphs(cifar_resnet(6), torch.randn(2, 3, 8, 8))[0]
    model = _model(jg, max_cuts=8)
    frontier = model._frontier()
    inner = frontier[model.cuts[:-1]]
    assert len(model.cuts) <= 8 and model.cuts[-1] == len(jg.forward) - 1
    assert np.median(inner) <= np.median(frontier)
