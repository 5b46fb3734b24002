"""Submodules with a graph break inside are recomputed whole, as non-reentrant
``torch.utils.checkpoint`` does (``memfit.execution.regions``): training equals plain PyTorch bit
for bit (dropout masks, BatchNorm statistics), the peak drops well below plain's, ``"none"`` is
untouched, and the warning says what memfit did and where."""

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
from memfit.execution.regions import choose_regions
from memfit.planning.policy import Policy, parse_policy


class BranchyLayer(nn.Module):
    """Linear, BatchNorm, ReLU, dropout, then a Python `if` on a tensor: a graph break.

    ``threshold=0.4`` sits at the mean of a ReLU of a standard normal, so the first row's
    dropout mask decides the branch (both are taken: a recomputation that drew other masks
    would take the other one); ``0.0`` always takes the first (one branch is ever compiled)."""

    def __init__(self, width: int, threshold: float = 0.4) -> None:
        super().__init__()
        self.threshold = threshold
        self.fc1 = nn.Linear(width, width)
        self.bn = nn.BatchNorm1d(width)
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.bn(self.fc1(x))))
        if h[0].mean() > self.threshold:  # data-dependent control flow
            h = torch.tanh(h) * 2
        else:
            h = torch.sigmoid(h)
        return x + self.fc2(h)


#: the line of the data-dependent `if` (the break Dynamo reports)
_BRANCH_LINE = BranchyLayer.forward.__code__.co_firstlineno + 2


class BranchyNet(nn.Module):
    def __init__(self, width: int = 256, depth: int = 8, threshold: float = 0.4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(BranchyLayer(width, threshold) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _step(model: nn.Module, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(x).square().mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_regions_train_exactly_like_plain_pytorch() -> None:
    torch.manual_seed(0)
    plain = BranchyNet(width=64, depth=4)
    ours = copy.deepcopy(plain)
    wrapped = memfit.checkpoint(ours, "memory")
    x = torch.randn(256, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for seed in range(3):  # the first call finds the regions; the next two recompute them
            expected_loss, expected = _step(plain, x, seed)
            loss, got = _step(wrapped, x, seed)
            assert torch.equal(loss, expected_loss), seed  # the same dropout masks
            assert len(got) == len(expected)
            for g, e in zip(got, expected):
                assert torch.equal(g, e), seed
            for (name, b), c in zip(plain.named_buffers(), ours.buffers()):
                assert torch.equal(b, c), (seed, name)  # BatchNorm statistics updated once
    assert [r.module for r in wrapped.memfit.plan.regions] == [f"layers.{i}" for i in range(4)]
    # between calls the user's model is as it was (its own calls, torch.save, state_dict)
    assert all("forward" not in layer.__dict__ for layer in ours.layers)


def _peak(model: nn.Module, x: torch.Tensor) -> int:
    # a sum: its gradient is an expanded scalar, so nothing outside the model is held between
    # forward and backward and the wrapper has nothing to plan again for
    result = memfit.measure(lambda: model(x).sum().backward())
    assert result.peak_bytes is not None
    model.zero_grad(set_to_none=True)
    return result.peak_bytes


@pytest.mark.slow
def test_memory_recomputes_regions_and_none_keeps_what_plain_keeps() -> None:
    x = torch.randn(1024, 128)  # 512 KiB per activation, 8 layers
    torch.manual_seed(0)
    # one branch: every call runs the graphs planned on the first
    plain = BranchyNet(width=128, threshold=0.0)
    plain(x).sum().backward()  # gradients exist, as in the wrapped runs
    plain_peak = _peak(plain, x)
    peaks = {}
    for policy in ("none", "memory"):
        torch.compiler.reset()
        wrapped = memfit.checkpoint(copy.deepcopy(plain), policy)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # the first call finds the regions, the second plans the graphs inside them, and
            # memfit plans again where their first backwards showed outputs dropped that the
            # plans assumed held (this loop drops the model's output before the backward)
            for i in range(6):
                wrapped(x).sum().backward()
                if i >= 2 and not wrapped.memfit.replan_pending:
                    break
            peaks[policy] = _peak(wrapped, x)
        assert not wrapped.memfit.replan_pending
        if policy == "none":
            assert wrapped.memfit.plan.regions == ()
        else:
            plan = wrapped.memfit.plan
            assert len(plan.regions) == 8
            # this model's Python between its graphs allocates nothing the backward keeps, so
            # the prediction covers the step
            assert abs(plan.predicted_peak_bytes - peaks[policy]) <= 0.1 * peaks[policy]
    assert peaks["memory"] <= 0.6 * plain_peak, (peaks, plain_peak)
    assert peaks["none"] <= 1.02 * plain_peak, (peaks, plain_peak)


def test_warning_says_what_memfit_did_and_where() -> None:
    model = BranchyNet(width=32, depth=2)
    wrapped = memfit.checkpoint(model, "memory")
    x = torch.randn(16, 32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped(x).sum().backward()  # the line the warning is attributed to
        call_line = _this_line() - 1
        wrapped(x).sum().backward()
    ours = [w for w in caught if "memfit could not capture" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    message = str(ours[0].message)
    assert ours[0].filename == __file__ and ours[0].lineno == call_line
    assert f"test_regions.py:{_BRANCH_LINE}" in message  # the `if` in BranchyLayer.forward
    assert "layers.0, layers.1" in message and "recomputes each call" in message


def test_a_policy_that_recomputes_nothing_says_so() -> None:
    wrapped = memfit.checkpoint(BranchyNet(width=32, depth=2), "none")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped(torch.randn(16, 32)).sum().backward()
    message = next(str(w.message) for w in caught if "could not capture" in str(w.message))
    assert "policy 'none' does not recompute the modules the breaks are in (layers.0" in message


def test_plan_shows_the_regions_without_training() -> None:
    model = BranchyNet(width=32, depth=3)
    before = [b.clone() for b in model.buffers()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = memfit.plan(model, torch.randn(16, 32), policy=0.5)
    assert [r.module for r in plan.regions] == ["layers.0", "layers.1", "layers.2"]
    assert all(r.kind == "BranchyLayer" and "test_regions.py" in r.where for r in plan.regions)
    assert "recomputed whole  3 calls of layers.0" in str(plan)
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers()))


def test_choose_regions_picks_the_innermost_modules_the_policy_recomputes() -> None:
    observed = {"", "blocks.0", "blocks.0.attn", "blocks.1", "blocks.1.attn", "head"}
    innermost = ("blocks.0.attn", "blocks.1.attn", "head")
    assert choose_regions(observed, parse_policy("memory")) == innermost
    assert choose_regions(observed, parse_policy(0.5)) == innermost
    for name in ("none", "speed", "collection", "swap"):
        assert choose_regions(observed, parse_policy(name)) == (), name
    assert choose_regions(observed, Policy("memory", offload=True)) == ()
    # a list: a listed region's output is kept anyway; one containing a listed module is not
    # recomputed, or the listed output would be
    listed = parse_policy(["blocks.0.attn.proj", "head"])
    assert choose_regions(observed, listed) == ("blocks.1.attn", "head")


def _this_line() -> int:
    import inspect

    frame = inspect.currentframe()
    assert frame is not None and frame.f_back is not None
    return frame.f_back.f_lineno


class DrawingLayer(nn.Module):
    """A layer whose Python draws (numpy, Python's ``random``, a generator of its own) around a
    graph break, with dropout: recomputed whole, its Python must draw the same again."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)
        self.drop = nn.Dropout(0.2)
        self.gen = torch.Generator().manual_seed(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.fc1(x)))
        masked = np.random.choice(np.arange(self.width), self.width // 4, replace=False)
        keep = np.ones(self.width, dtype=np.float32)
        keep[masked] = 0
        h = h * torch.from_numpy(keep) * (torch.rand(self.width, generator=self.gen) > 0.2)
        if h.sum() > 0:  # data-dependent control flow
            h = torch.tanh(self.fc2(h)) * random.random()
        else:
            h = torch.sigmoid(self.fc2(h))
        return x + self.drop(h) * (1 + np.random.rand(1).item())


@pytest.mark.slow
def test_a_regions_python_draws_the_same_again_when_recomputed() -> None:
    """Under ``"memory"`` each layer is recomputed whole, its Python run again: its numpy,
    ``random`` and own-generator draws are those of its forward, and every stream ends the
    step where plain PyTorch's does."""
    torch.manual_seed(0)
    plain = nn.Sequential(DrawingLayer(32), DrawingLayer(32))
    ours = copy.deepcopy(plain)
    wrapped = memfit.checkpoint(ours, "memory")
    x = torch.randn(64, 32)

    def states(model: nn.Module) -> tuple[Any, ...]:
        _, keys, position, *_ = np.random.get_state()
        own = [layer.gen.get_state() for layer in model]
        return torch.get_rng_state(), random.getstate(), keys, position, own

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for seed in range(3):  # the first call finds the regions; the next two recompute them
            random.seed(seed)
            np.random.seed(seed)
            expected_loss, expected = _step(plain, x, seed)
            expected_states = states(plain)
            random.seed(seed)
            np.random.seed(seed)
            loss, got = _step(wrapped, x, seed)
            got_states = states(ours)
            assert torch.equal(loss, expected_loss), seed
            assert len(got) == len(expected) and all(map(torch.equal, got, expected)), seed
            assert torch.equal(got_states[0], expected_states[0]), seed
            assert got_states[1] == expected_states[1], seed
            assert np.array_equal(got_states[2], expected_states[2]), seed
            assert got_states[3] == expected_states[3], seed
            assert all(map(torch.equal, got_states[4], expected_states[4])), seed
    assert [r.module for r in wrapped.memfit.plan.regions] == ["0", "1"]
