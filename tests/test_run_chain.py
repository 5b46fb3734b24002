"""execution.run_chain: graph runs of a step with graph breaks in the model's own Python, dropped in
the forward and replayed in the backward. Plain PyTorch is the oracle for losses, gradients,
BatchNorm statistics and dropout masks; ``memfit.measure`` for the peaks."""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import memfit
from memfit.execution import run_chain as chain_module

MB = 10**6


def pair_block(a: nn.Module, b: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Two Linears, then an activation chosen by a data-dependent branch (a graph break)."""
    x = b(torch.relu(a(x)))
    if x.mean() > 0:
        return torch.tanh(x)
    return torch.sigmoid(x)


class Pairs(nn.Module):
    """The issue's model: a loop over layer pairs with a branch after each (the branch in a
    function the loop calls: a break in the loop's own body makes Dynamo skip the frame)."""

    def __init__(self, n: int = 8, width: int = 64) -> None:
        super().__init__()
        self.a = nn.ModuleList(nn.Linear(width, width) for _ in range(n))
        self.b = nn.ModuleList(nn.Linear(width, width) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for a, b in zip(self.a, self.b):
            x = pair_block(a, b, x)
        return x


def tanh_block(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    x = torch.tanh(layer(x))
    if x.sum().item() > 0:  # .item(): a graph break, then a branch on a Python float
        return x * 0.5
    return x * 0.25 + 0.1


class TanhChain(nn.Module):
    def __init__(self, n: int = 100, width: int = 64) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = tanh_block(layer, x)
        return x


def norm_block(layer: nn.Module, bn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    x = F.dropout(torch.tanh(bn(layer(x))), 0.2, training=True)
    if x.mean() > 0.05:
        return torch.sigmoid(x) * 2
    return torch.relu(x)


class NormChain(nn.Module):
    """BatchNorm and dropout between breaks."""

    def __init__(self, n: int = 8, width: int = 64) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(n))
        self.norms = nn.ModuleList(nn.BatchNorm1d(width) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer, bn in zip(self.layers, self.norms):
            x = norm_block(layer, bn, x)
        return x


def _step(model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, seed: int) -> float:
    torch.manual_seed(seed)
    loss = model(x).square().mean()
    loss.backward()
    return loss.item()


def _warm(wrapped: nn.Module, x: torch.Tensor, steps: int = 5) -> None:
    """Calls until memfit has captured, found the chain, tried its plans and settled."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the graph-break warning
        for s in range(steps):
            _step(wrapped, x, s)
            wrapped.zero_grad(set_to_none=True)


def _chained(model: nn.Module, policy: object = "memory") -> nn.Module:
    return memfit.checkpoint(copy.deepcopy(model), policy)


def test_losses_gradients_statistics_and_dropout_masks_equal_plain_pytorch() -> None:
    torch.manual_seed(0)
    plain = NormChain()
    x = torch.randn(256, 64)
    wrapped = _chained(plain)
    _warm(wrapped, x)
    wrapped.load_state_dict(plain.state_dict())  # the same statistics to start from
    for seed in (11, 12, 13):  # dropout masks differ per step, and so may the branches
        want = _step(plain, x, seed)
        got = _step(wrapped, x, seed)
        assert got == want
        for p, q in zip(plain.parameters(), wrapped.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)
        for p, q in zip(plain.buffers(), wrapped.buffers(), strict=True):
            assert torch.equal(p, q)  # BatchNorm's statistics updated once, as in plain
        plain.zero_grad(set_to_none=True)
        wrapped.zero_grad(set_to_none=True)
    chain = wrapped.memfit.plan.chain
    assert chain is not None and chain.segments  # runs were dropped and replayed
    assert "across breaks" in str(wrapped.memfit.plan)


def test_a_replay_draws_the_random_numbers_its_forward_drew(monkeypatch) -> None:
    """The negative control: replayed without the forward's random state, dropout draws other
    masks and the gradients differ; with it (the test above), they are equal."""
    torch.manual_seed(0)
    plain = NormChain()
    x = torch.randn(256, 64)
    wrapped = _chained(plain)
    _warm(wrapped, x)
    assert wrapped.memfit.plan.chain.segments
    monkeypatch.setattr(chain_module, "_random_state", lambda args: None)
    _step(plain, x, 3)
    _step(wrapped, x, 3)
    assert not all(
        torch.equal(p.grad, q.grad)
        for p, q in zip(plain.parameters(), wrapped.parameters(), strict=True)
    )


def test_a_backward_that_keeps_the_graph_replays_again() -> None:
    torch.manual_seed(0)
    plain = NormChain(n=4)
    x = torch.randn(128, 64)
    wrapped = _chained(plain)
    _warm(wrapped, x)
    wrapped.load_state_dict(plain.state_dict())
    for model in (plain, wrapped):
        torch.manual_seed(5)
        loss = model(x).square().mean()
        loss.backward(retain_graph=True)
        loss.backward()
    for p, q in zip(plain.parameters(), wrapped.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_micro_batches_accumulate_as_in_plain_pytorch() -> None:
    torch.manual_seed(0)
    plain = Pairs(n=4, width=32)
    x = torch.randn(2, 512, 32)
    wrapped = _chained(plain)
    _warm(wrapped, x[0])
    for model in (plain, wrapped):
        losses = [model(x[i]).square().mean() for i in range(2)]  # both forwards, then
        for loss in reversed(losses):  # their backwards, the later first
            loss.backward()
    for p, q in zip(plain.parameters(), wrapped.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_a_value_changed_in_place_after_the_forward_is_refused_as_plain_pytorch_refuses() -> None:
    torch.manual_seed(0)
    model = _chained(Pairs(n=4, width=32))
    x = torch.randn(512, 32)
    _warm(model, x)
    assert model.memfit.plan.chain.segments
    plain = Pairs(n=4, width=32)
    for run in (plain, model):
        h = x.clone().requires_grad_() * 1.0  # a value autograd made: its version is checked
        out = run(h)
        h.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()


@pytest.mark.slow
def test_eight_layer_pairs_take_at_most_half_of_plain_pytorchs_memory() -> None:
    torch.manual_seed(0)
    plain = Pairs(n=8, width=64)
    x = torch.randn(8192, 64)  # activations of 2 MiB: they, not the weights, fill memory
    wrapped = _chained(plain)
    _warm(wrapped, x)
    base = memfit.measure(lambda: _step(plain, x, 0)).peak_bytes
    peak = memfit.measure(lambda: _step(wrapped, x, 0)).peak_bytes
    for p, q in zip(plain.parameters(), wrapped.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    assert peak <= 0.5 * base
    assert peak == pytest.approx(wrapped.memfit.plan.predicted_peak_bytes, rel=0.05)


@pytest.mark.slow
def test_a_hundred_layer_chain_broken_after_each_layer_peaks_within_the_sqrt_n_bound() -> None:
    n = 100
    torch.manual_seed(0)
    model = TanhChain(n)
    x = torch.randn(4096, 64)  # 1 MiB activations
    wrapped = _chained(model)
    _warm(wrapped, x)
    peak = memfit.measure(lambda: _step(wrapped, x, 0)).peak_bytes
    assert peak <= (2.5 * math.sqrt(n) + 3) * MB
    assert peak == pytest.approx(wrapped.memfit.plan.predicted_peak_bytes, rel=0.05)
    # the branches follow the data: other inputs take other branches, planned without a capture
    compiles = wrapped.memfit._planned.shapes_planned
    for seed in range(3):
        other = torch.randn(4096, 64, generator=torch.Generator().manual_seed(seed)) * 3
        peak = memfit.measure(lambda other=other: _step(wrapped, other, 0)).peak_bytes
        assert peak <= (2.5 * math.sqrt(n) + 3) * MB
    assert wrapped.memfit._planned.shapes_planned == compiles


def test_a_byte_budget_holds_for_a_step_whose_runs_are_dropped() -> None:
    torch.manual_seed(0)
    plain = Pairs(n=8, width=32)
    x = torch.randn(4096, 32)
    base = memfit.measure(lambda: _step(plain, x, 0)).peak_bytes
    budget = int(0.5 * base)  # below what any plans of the graphs reach together
    wrapped = _chained(plain, budget)
    _warm(wrapped, x, steps=12)  # held by the chain, its graphs keeping the least tried
    peak = memfit.measure(lambda: _step(wrapped, x, 0)).peak_bytes
    plan = wrapped.memfit.plan
    assert plan.chain is not None and plan.chain.segments
    assert plan.predicted_peak_bytes <= budget
    assert peak <= budget
    assert peak <= 1.05 * plan.predicted_peak_bytes
    for p, q in zip(plain.parameters(), wrapped.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
