"""What happens around every memfit call (``execution.planned_call``): one plan per input shape, the
plan of the shape that just ran, memfit's own shape limit, no silent unplanned run, and the
randomness a model draws in its own Python drawn as plain PyTorch draws it."""

from __future__ import annotations

import copy
import random
import warnings
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn

import memfit
from lm_models import VOCAB, batch, lm, lm_loss


def _mlp(width: int = 32, depth: int = 4) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def _train_call(model: nn.Module, batch: int, width: int = 32) -> list[warnings.WarningMessage]:
    """A step holding the model's output through the backward, as memfit assumes of a model
    that returns no loss: nothing it sees at the first backward makes it plan again."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model(torch.randn(batch, width))
        out.sum().backward()
    return caught


def test_the_plan_is_that_of_the_shape_the_last_call_ran() -> None:
    """Back to a batch size planned before, the plan is that shape's again, not the last made."""
    wrapped = memfit.checkpoint(_mlp(), "none")
    peaks = {}
    for size in (64, 16):
        _train_call(wrapped, size)
        peaks[size] = wrapped.memfit.plan.predicted_peak_bytes
    assert peaks[64] > peaks[16]
    _train_call(wrapped, 64)  # cached graph: Dynamo does not call the backend again
    assert wrapped.memfit.plan.predicted_peak_bytes == peaks[64]
    x = torch.randn(64, 32)

    def step() -> None:
        out = wrapped(x)
        out.sum().backward()

    assert memfit.measure(step).peak_bytes == pytest.approx(peaks[64], rel=0.1)


@pytest.mark.slow
def test_more_captures_than_dynamos_limit_across_models_all_plan() -> None:
    """Dynamo's limit (8) is per code object and all compiled modules share one; memfit's
    wrappers each keep their own count, so more than 8 captures over 9 models all get plans.
    (Dynamo also remembers per code object that the batch size varied: from the second model on,
    the first capture already has it as a symbol, and serves both sizes.)"""
    captures = 0
    for _ in range(9):
        wrapped = memfit.checkpoint(_mlp(), "memory")
        peaks = []
        for size in (4, 12):
            caught = _train_call(wrapped, size)
            assert not [w for w in caught if "plain PyTorch" in str(w.message)]
            peaks.append(wrapped.memfit.plan.predicted_peak_bytes)
        assert peaks == sorted(set(peaks))  # each call planned, and its plan is its size's
        captures += wrapped.memfit._planned.shapes_planned
    assert captures > 8
    assert torch._dynamo.config.recompile_limit == 8  # only raised around memfit's calls


def test_captures_past_dynamos_process_wide_cap_all_plan() -> None:
    """Dynamo's ``accumulated_recompile_limit`` caps the variants of one code object over every
    ``torch.compile`` in the process (256; 44 of 300 wrappers ran unplanned past it); memfit
    lifts it around its calls. Here the cap is 3, 5 wrappers all plan, and it is 3 again after."""
    import torch._dynamo.config as dynamo_config

    with dynamo_config.patch(accumulated_recompile_limit=3):
        for _ in range(5):
            wrapped = memfit.checkpoint(_mlp(), "none")
            caught = _train_call(wrapped, 4)
            assert not [w for w in caught if "plain PyTorch" in str(w.message)]
            assert wrapped.memfit.plan.graphs
        assert dynamo_config.accumulated_recompile_limit == 3


def test_past_max_shapes_a_new_shape_runs_unplanned_with_a_warning_at_the_users_line() -> None:
    """A new batch size needs a second capture (the size as a symbol): past ``max_shapes=1`` it
    runs unplanned, with a warning."""
    wrapped = memfit.checkpoint(_mlp(), "memory", options=memfit.Options(max_shapes=1))
    plain = _mlp()
    assert not _train_call(wrapped, 8)
    eight = wrapped.memfit.plan.predicted_peak_bytes
    caught = _train_call(wrapped, 12)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "max_shapes=1" in message and "plain PyTorch" in message
    assert caught[0].filename == __file__  # the user's line, not torch's internals
    with pytest.raises(RuntimeError, match="max_shapes=1"):
        wrapped.memfit.plan  # noqa: B018 - no stale plan for a call that ran unplanned
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
    assert wrapped.memfit.plan.predicted_peak_bytes == eight


def test_inference_calls_keep_the_training_plan() -> None:
    wrapped = memfit.checkpoint(_mlp(), "memory")
    _train_call(wrapped, 8)
    plan = wrapped.memfit.plan
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        wrapped(torch.randn(8, 32))
        wrapped.eval()
        wrapped(torch.randn(5, 32))
    wrapped.train()
    assert wrapped.memfit.plan is plan


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_max_shapes_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="max_shapes"):
        memfit.checkpoint(_mlp(), options=memfit.Options(max_shapes=bad))  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["none", "memory", "budget"])
def test_a_loss_outside_the_wrapper_is_measured_and_reserved_from_the_second_step(
    policy: str,
) -> None:
    """``criterion(model(x), y)`` with the model wrapped alone: the first step measures what the
    loss holds between forward and backward (here a log-softmax over 2,000 words and its
    gradient), says so once, and the plan made again reserves it, so from the second step the
    prediction covers the whole step and a byte budget holds."""
    model, (x, y) = lm(), batch()
    reference = lm()
    options = {"policy": "28MiB" if policy == "budget" else policy}
    wrapped = memfit.checkpoint(model, **options)  # type: ignore[arg-type]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = memfit.measure(lambda: lm_loss(wrapped, x, y).backward())
    ours = [w for w in caught if "outside memfit's graphs" in str(w.message)]
    assert len(ours) == 1 and ours[0].filename == __file__
    assert first.peak_bytes > 1.05 * wrapped.memfit.plan.predicted_peak_bytes  # the loss was unseen
    model.zero_grad(set_to_none=True)
    for _ in range(2):
        step = memfit.measure(lambda: lm_loss(wrapped, x, y).backward())
        predicted = wrapped.memfit.plan.predicted_peak_bytes
        assert wrapped.memfit.plan.outside_bytes > 0
        assert step.peak_bytes == pytest.approx(predicted, rel=0.05)
        if policy == "budget":
            assert step.peak_bytes <= 1.05 * 28 * 2**20
        model.zero_grad(set_to_none=True)
    lm_loss(wrapped, x, y).backward()
    lm_loss(reference, x, y).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_measure_outside_false_keeps_the_first_plan() -> None:
    model, (x, y) = lm(), batch()
    wrapped = memfit.checkpoint(model, "memory", options=memfit.Options(measure_outside=False))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "outside memfit's graphs" warning
        for _ in range(2):
            lm_loss(wrapped, x, y).backward()
        # the logits are gone before the backward, not as assumed: planned again once
        assert wrapped.memfit.replan_pending
        lm_loss(wrapped, x, y).backward()
        plan = wrapped.memfit.plan
        assert not wrapped.memfit.replan_pending
        lm_loss(wrapped, x, y).backward()
    assert wrapped.memfit.plan.outside_bytes == 0
    assert wrapped.memfit.plan.graphs == plan.graphs


def test_replan_pending_says_the_next_call_plans_again() -> None:
    model, (x, y) = lm(), batch()
    wrapped = memfit.checkpoint(model, "none")
    for _ in range(2):
        lm_loss(wrapped, x, y).backward()
    assert wrapped.memfit.replan_pending  # the logits are gone before the backward
    lm_loss(wrapped, x, y).backward()
    assert not wrapped.memfit.replan_pending  # on CPU nothing is measured outside memfit.measure
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        memfit.measure(lambda: lm_loss(wrapped, x, y).backward())
    assert wrapped.memfit.replan_pending
    lm_loss(wrapped, x, y).backward()
    assert not wrapped.memfit.replan_pending and wrapped.memfit.plan.outside_bytes > 0


@pytest.mark.slow
def test_a_loss_outside_measured_at_one_length_is_reserved_at_every_length() -> None:
    """With the length as a symbol, what the loss holds outside the wrapper (measured once, at
    one length) is reserved at every other length in proportion to the model's outputs (the
    logits it reads): the predictions cover the whole step at lengths never measured."""
    model = lm()
    wrapped = memfit.checkpoint(model, "memory")
    g = torch.Generator().manual_seed(1)

    def step(length: int) -> int:
        x, y = (torch.randint(0, VOCAB, (16, length), generator=g) for _ in range(2))
        peak = memfit.measure(lambda: lm_loss(wrapped, x, y).backward()).peak_bytes
        model.zero_grad(set_to_none=True)
        return int(peak or 0)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for length in (64, 48):  # the first capture, then the length as a symbol
            x, y = (torch.randint(0, VOCAB, (16, length), generator=g) for _ in range(2))
            lm_loss(wrapped, x, y).backward()
            model.zero_grad(set_to_none=True)
        step(48)  # measures the loss outside: planned again from the next call
    assert wrapped.memfit.replan_pending
    for length in (80, 40):
        measured = step(length)
        assert wrapped.memfit.plan.outside_bytes > 0 and wrapped.memfit.plan.sizes
        assert measured == pytest.approx(wrapped.memfit.plan.predicted_peak_bytes, rel=0.05)
    assert not wrapped.memfit.replan_pending


def test_swap_that_offloads_nothing_says_so_once() -> None:
    """On CPU no copy hides behind compute: "swap" offloads nothing, and says what would work."""
    wrapped = memfit.checkpoint(_mlp(width=64, depth=6), "swap")
    caught = _train_call(wrapped, 64, width=64)
    assert wrapped.memfit.plan.graphs[0].offloaded_bytes == 0
    said = [w for w in caught if "'swap' offloaded nothing" in str(w.message)]
    assert len(said) == 1 and "offload=True" in str(said[0].message)
    assert not [w for w in _train_call(wrapped, 64, width=64) if "swap" in str(w.message)]


def test_a_budget_with_the_loss_outside_on_cpu_is_measured_and_held() -> None:
    """On CPU, with no ``memfit.measure`` around it, a budget measures what a loss computed
    outside the model holds on the first step (a recording of its own, ended by the optimizer's
    step) and plans again with it reserved: from then on the step peaks within its budget and
    at its prediction, to the byte. It peaked 1.12-1.44x over its budget before."""
    model, (x, y) = lm(), batch()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    wrapped = memfit.checkpoint(model, 0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            lm_loss(wrapped, x, y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    assert not [w for w in caught if "cannot see what that code holds" in str(w.message)]
    measured = memfit.measure(lambda: lm_loss(wrapped, x, y).backward()).peak_bytes
    plan = wrapped.memfit.plan
    assert plan.outside_bytes > 0 and plan.budget_bytes is not None
    assert measured == plan.predicted_peak_bytes <= plan.budget_bytes


def test_a_budget_with_the_loss_outside_under_a_users_profiler_says_so_and_measures_later() -> None:
    """Under a user's own profiler memfit cannot record: a budget says so once, at the first
    step, with what to do, and measures on the first step outside that profiler."""
    model, (x, y) = lm(), batch()
    wrapped = memfit.checkpoint(model, 0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            lm_loss(wrapped, x, y).backward()
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            lm_loss(wrapped, x, y).backward()
    said = [w for w in caught if "cannot see what that code holds" in str(w.message)]
    assert len(said) == 1 and "memfit.step" in str(said[0].message)
    assert wrapped.memfit.plan.outside_bytes > 0


def test_a_budget_on_a_model_returning_its_loss_says_nothing_of_the_loss() -> None:
    model = memfit.checkpoint(_LossModel(), 0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(64, 32)).backward()
    assert not [w for w in caught if "cannot see what that code holds" in str(w.message)]


class _LossModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = _mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).square().mean()


class PythonDraws(nn.Module):
    """Draws in its own Python as SpecAugment does (numpy's ``rand(1).item()`` and ``choice``,
    Python's ``random``), with dropout before and after, and a graph break (a Python ``if`` on
    a tensor) between its numpy draws."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.width = width
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)
        self.fc3 = nn.Linear(width, 1)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.fc1(x)))
        scale = 1 + np.random.rand(1).item()
        masked = np.random.choice(np.arange(self.width), self.width // 4, replace=False)
        keep = np.ones(self.width, dtype=np.float32)
        keep[masked] = 0
        h = h * torch.from_numpy(keep) * scale
        if h.sum() > 0:  # a graph break between the numpy draws
            h = torch.tanh(self.fc2(h)) * random.random()
        else:
            h = torch.sigmoid(self.fc2(h))
        column = int(np.random.randint(0, self.width))
        h = self.drop(h) * (torch.arange(self.width) != column)
        return self.fc3(h).square().mean()


def _steps(model: nn.Module, steps: int) -> list[tuple[Any, ...]]:
    """Each step's loss, gradients and, after it, torch's, Python's and numpy's random states;
    every stream seeded once, before the first."""
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    out = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        loss = model(x)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        _, keys, position, *_ = np.random.get_state()
        out.append((loss.detach(), grads, torch.get_rng_state(), random.getstate(), keys, position))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["none", "memory", 0.5])
def test_randomness_drawn_in_the_models_python_is_drawn_as_plain_pytorch_draws_it(
    policy: str | float,
) -> None:
    """Losses and gradients bit-equal to plain PyTorch's at every step, and every random stream
    where plain's leaves it: numpy's draws are numpy's, drawn once a step."""
    torch.manual_seed(0)
    plain = PythonDraws()
    ours = copy.deepcopy(plain)
    expected = _steps(plain, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the graph break's warning
        got = _steps(memfit.checkpoint(ours, policy), 4)
    for step, (e, g) in enumerate(zip(expected, got)):
        assert torch.equal(g[0], e[0]), step
        assert len(g[1]) == len(e[1]) and all(map(torch.equal, g[1], e[1])), step
        assert torch.equal(g[2], e[2]), step
        assert g[3] == e[3], step
        assert np.array_equal(g[4], e[4]) and g[5] == e[5], step
