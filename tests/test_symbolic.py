"""One capture for many sizes (``execution.symbolic``): a size that varies between calls is
captured once more as a symbol, and that graph serves every size in its plan's range, each call
reporting the plan at its own sizes; a size outside the range is captured again."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import memfit
from memfit.bench.zoo import case


def _captures(owner: object) -> int:
    """Captures planned by a ``memfit.step``, or by the model memfit is applied to."""
    state = owner.memfit if isinstance(owner, memfit.CheckpointedModule) else owner
    return state._planned.shapes_planned  # type: ignore[attr-defined]


@pytest.mark.slow
def test_one_capture_serves_every_sequence_length() -> None:
    """HuggingFace GPT-2 (the zoo's) trained on six lengths: two captures (the first length, then
    the length as a symbol), gradients bit for bit plain PyTorch's, and each call's plan predicts
    that call's measured peak."""
    gpt2 = case("gpt2")
    model, reference = gpt2.make_model(), gpt2.make_model()
    # bit for bit: the loss head as written (its kernel, to fp tolerance: test_loss_head.py)
    off = memfit.Options(loss_head="off")
    step = memfit.step(
        lambda ids: model(input_ids=ids, labels=ids, use_cache=False).loss, options=off
    )
    g = torch.Generator().manual_seed(0)
    planned_at = set()
    for length in (16, 24, 40, 33, 56, 24):
        ids = torch.randint(0, 100, (2, length), generator=g)
        if length in (16, 24) and length not in {s for p in planned_at for _, s in p}:
            step(ids).backward()  # the captures: measured elsewhere (test_planned_call, test_step)
        else:
            measured = memfit.measure(lambda ids=ids: step(ids).backward()).peak_bytes
            assert measured == pytest.approx(step.plan.predicted_peak_bytes, rel=0.05)
        plan = step.plan
        planned_at.add(plan.graphs[0].planned_sizes)
        if length != 16:
            assert list(plan.sizes.values()) == [length]  # the prediction is this call's
        if length == 40:
            assert "predicted at s" in str(plan) and "decisions chosen at" in str(plan)
        reference(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
    assert _captures(step) == 2
    assert planned_at == {(), plan.graphs[0].planned_sizes}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(256, 256), nn.Tanh()]
    return nn.Sequential(*layers)


@pytest.mark.slow
def test_a_byte_budget_holds_at_every_batch_size_and_beyond_its_range_plans_again() -> None:
    model = _mlp()
    budget = 3 * 2**20
    step = memfit.step(lambda x: model(x).square().mean(), policy=budget)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no budget miss, no unplanned call
        for batch in (64, 96):  # the first capture, then the batch size as a symbol
            step(torch.randn(batch, 256)).backward()
            model.zero_grad(set_to_none=True)
        ((_, _, hi),) = step.plan.graphs[0].size_range
        batches = (64, 96, 80, 128, hi + 9, 72)  # hi + 9 is captured again
        inputs = [torch.randn(batch, 256) for batch in batches]
        for x in inputs:  # captures as needed (measured in test_planned_call and test_step)
            step(x).backward()
            model.zero_grad(set_to_none=True)
        captures = _captures(step)
        seen = []
        for x in inputs:  # every size again, each running the graph captured for it
            measured = memfit.measure(lambda x=x: step(x).backward()).peak_bytes
            plan = step.plan
            assert plan.predicted_peak_bytes <= budget
            assert measured <= 1.01 * budget
            assert measured == pytest.approx(plan.predicted_peak_bytes, rel=0.05)
            seen.append((x.shape[0], plan.graphs[0].size_range))
            model.zero_grad(set_to_none=True)
    assert _captures(step) == captures == 3
    ranges = {r for _, r in seen if r}
    assert len(ranges) == captures - 1  # every capture but the first has a range
    for batch, r in seen[1:]:
        ((_, lo, hi),) = r
        assert lo <= batch and (hi is None or batch <= hi)


def test_a_size_marked_dynamic_is_captured_once() -> None:
    """``torch._dynamo.mark_dynamic`` on the first input: one capture for every batch size (it
    raised "unhashable type: non-nested SymInt" in memfit's analysis before)."""
    wrapped = memfit.checkpoint(_mlp(), "memory")
    for batch in (16, 40, 24):
        x = torch.randn(batch, 256)
        torch._dynamo.mark_dynamic(x, 0)
        wrapped(x).sum().backward()
        assert wrapped.memfit.plan.sizes and list(wrapped.memfit.plan.sizes.values()) == [batch]
    assert _captures(wrapped) == 1
