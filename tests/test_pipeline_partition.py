"""Stages cut from the captured forward compute exactly what the model computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from memfit.pipeline.partition import (
    PipelineCaptureError,
    capture_forward,
    crossing_bytes,
    cut_allowed,
    item_boundaries,
    split_stages,
)
from pipeline_models import build


def _chain(stages, captured, inputs):
    values = inputs
    for stage in stages:
        values = stage.module(*values)
    return captured.rebuild_output(values)


@pytest.mark.parametrize("name", ["mlp", "gpt", "skip"])
def test_stages_in_a_row_equal_the_model(name: str) -> None:
    """Bit for bit at module boundaries; to rounding anywhere (a value sent over the wire is made
    contiguous, and a matmul on a contiguous copy of a transposed view may sum in another
    order)."""
    model, x, _, _ = build(name)
    model.eval()  # dropout off, BatchNorm from running statistics: outputs are deterministic
    captured = capture_forward(model, (x,))
    expected = model(x)
    n = len(captured.nodes)
    modules = item_boundaries(captured)[1:-1]
    for cuts in (modules[len(modules) // 2 : len(modules) // 2 + 1], modules[1::2], modules):
        stages = split_stages(captured, cuts)
        assert torch.equal(_chain(stages, captured, (x,)), expected), cuts
    anywhere = [c for c, ok in enumerate(cut_allowed(captured)) if ok and 0 < c < n]
    assert len(anywhere) >= len(modules)
    stages = split_stages(captured, anywhere)
    torch.testing.assert_close(_chain(stages, captured, (x,)), expected, rtol=1e-6, atol=1e-6)


def test_training_stages_update_batchnorm_like_the_model() -> None:
    model, x, _, _ = build("skip")
    reference, _, _, _ = build("skip")
    for m in (model, reference):
        m.drop.p = 0.0
    captured = capture_forward(model, (x,))
    assert torch.equal(model.bn.running_mean, reference.bn.running_mean)  # capture restores
    stages = split_stages(captured, [len(captured.nodes) // 3, 2 * len(captured.nodes) // 3])
    out = _chain(stages, captured, (x,))
    assert torch.equal(out, reference(x))
    assert torch.equal(model.bn.running_mean, reference.bn.running_mean)
    assert torch.equal(model.bn.running_var, reference.bn.running_var)
    assert model.bn.num_batches_tracked.item() == 1


def test_stages_hold_the_models_own_parameters_under_their_names() -> None:
    model, x, _, _ = build("gpt")
    captured = capture_forward(model, (x,))
    stages = split_stages(captured, [3, len(captured.nodes) - 3])
    first = dict(stages[0].module.named_parameters())
    last = dict(stages[-1].module.named_parameters())
    assert first["emb.weight"] is model.emb.weight
    assert last["emb.weight"] is model.head.weight  # the tied weight: read by both ends
    names = {n for s in stages for n, _ in s.module.named_parameters()}
    assert names == {n for n, _ in model.named_parameters()}


def test_a_cut_through_a_tuple_of_tensors_is_refused() -> None:
    model, x, _, _ = build("gpt")
    captured = capture_forward(model, (x,))
    split = next(i for i, v in enumerate(captured.nodes) if v.name == "split")
    assert not cut_allowed(captured)[split + 1]
    with pytest.raises(ValueError, match="neither a tensor nor a literal"):
        split_stages(captured, [split + 1])


def test_a_value_read_far_ahead_is_relayed_and_counted_at_every_cut() -> None:
    model, x, _, _ = build("skip")
    captured = capture_forward(model, (x,))
    n = len(captured.nodes)
    stages = split_stages(captured, [n // 3, 2 * n // 3])
    first = next(v for v in captured.nodes if v.name == "first")
    assert first in stages[0].sends and first in stages[1].receives and first in stages[1].sends
    assert first in stages[2].receives
    crossing = crossing_bytes(captured)
    row = 8 * 24 * 4  # a [8, 24] float32 value
    assert all(crossing[c] >= row for c in range(captured.nodes.index(first) + 1, n))
    assert stages[1].receive_bytes == sum(
        v.meta["example_value"].numel() * 4 for v in stages[1].receives
    )


def test_candidate_cuts_follow_module_boundaries() -> None:
    model, x, _, _ = build("gpt")
    captured = capture_forward(model, (x,))
    cuts = item_boundaries(captured, max_items=8)
    assert cuts[0] == 0 and cuts[-1] == len(captured.nodes) and len(cuts) - 1 <= 8
    fine = item_boundaries(captured, max_items=1000)
    assert set(cuts) <= set(fine) and len(fine) > len(cuts)


def test_a_forward_with_a_graph_break_is_refused_by_name() -> None:
    class Breaks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            print("side effect")  # noqa: T201 - a graph break
            return self.fc(x)

    with pytest.raises(PipelineCaptureError, match="one graph"):
        capture_forward(Breaks(), (torch.randn(2, 4),))
