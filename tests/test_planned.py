"""What happens around every memfit call (``execution.planned``): one plan per input shape, the
plan of the shape that just ran, memfit's own shape limit, and no silent unplanned run."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import memfit


def _mlp(width: int = 32, depth: int = 4) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def _train_call(model: nn.Module, batch: int) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(batch, 32)).sum().backward()
    return caught


def test_the_plan_is_that_of_the_shape_the_last_call_ran() -> None:
    """Back to a batch size planned before, the plan is that shape's again, not the last made."""
    wrapped = memfit.checkpoint(_mlp(), "none")
    peaks = {}
    for batch in (64, 16):
        _train_call(wrapped, batch)
        peaks[batch] = wrapped.plan.predicted_peak_bytes
    assert peaks[64] > peaks[16]
    _train_call(wrapped, 64)  # cached graph: Dynamo does not call the backend again
    assert wrapped.plan.predicted_peak_bytes == peaks[64]
    measured = memfit.measure(lambda: wrapped(torch.randn(64, 32)).sum().backward())
    assert measured.peak_bytes == pytest.approx(peaks[64], rel=0.1)


def test_more_shapes_than_dynamos_limit_across_models_all_plan() -> None:
    """Dynamo's limit (8) is per code object and all compiled modules share one; memfit's
    wrappers each keep their own count, so 12 shapes over 3 models all get plans."""
    for _ in range(3):
        wrapped = memfit.checkpoint(_mlp(), "memory")
        peaks = []
        for batch in (4, 8, 12, 16):
            caught = _train_call(wrapped, batch)
            assert not [w for w in caught if "plain PyTorch" in str(w.message)]
            peaks.append(wrapped.plan.predicted_peak_bytes)
        assert peaks == sorted(set(peaks))  # each call planned, and its plan is its shape's
    assert torch._dynamo.config.recompile_limit == 8  # only raised around memfit's calls


def test_past_max_shapes_a_new_shape_runs_unplanned_with_a_warning_at_the_users_line() -> None:
    wrapped = memfit.checkpoint(_mlp(), "memory", max_shapes=2)
    plain = _mlp()
    for batch in (4, 8):
        assert not _train_call(wrapped, batch)
    eight = wrapped.plan.predicted_peak_bytes
    caught = _train_call(wrapped, 12)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "max_shapes=2" in message and "plain PyTorch" in message
    assert caught[0].filename == __file__  # the user's line, not torch's internals
    with pytest.raises(RuntimeError, match="max_shapes=2"):
        wrapped.plan  # noqa: B018 - no stale plan for a call that ran unplanned
    # It ran, correctly: same gradients as plain PyTorch on the same input.
    x = torch.randn(12, 32)
    for p in wrapped.parameters():
        p.grad = None
    wrapped(x).sum().backward()
    plain(x).sum().backward()
    for p, q in zip(wrapped.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    # A shape planned before still runs its plan, and the plan is back.
    assert not _train_call(wrapped, 8)
    assert wrapped.plan.predicted_peak_bytes == eight


def test_inference_calls_keep_the_training_plan() -> None:
    wrapped = memfit.checkpoint(_mlp(), "memory")
    _train_call(wrapped, 8)
    plan = wrapped.plan
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        wrapped(torch.randn(8, 32))
        wrapped.eval()
        wrapped(torch.randn(5, 32))
    wrapped.train()
    assert wrapped.plan is plan


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_max_shapes_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="max_shapes"):
        memfit.checkpoint(_mlp(), max_shapes=bad)  # type: ignore[arg-type]
