"""Gradient accumulation: memfit adds each new gradient into ``.grad`` as the backward makes it.

Plain PyTorch accumulating over micro-batches is the oracle: ``.grad`` equal bit for bit, and an
accumulating micro-batch holds no more memory than plain's (it held every new gradient of the
graph at once before: 8x plain on this MLP). Where a leaf's gradient must be seen by something
(a tensor hook, ``torch.autograd.grad``, ``backward(inputs=...)``) autograd accumulates as before.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import memfit
from memfit.execution.accumulate import accumulate_into_grads

MiB = 2**20


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(512, 512), nn.Tanh()]
    return nn.Sequential(*layers)


def _batches(n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 512, generator=g) for _ in range(n)]


def _accumulate(
    model: nn.Module, run: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[list[int], list[torch.Tensor]]:
    """Peak of each micro-batch's step, and ``.grad`` after them all."""
    peaks = []
    for x in _batches():
        peaks.append(memfit.measure(lambda x=x: run(x).square().mean().backward()).peak_bytes)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return peaks, grads


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def _warm(wrapped: Callable[[torch.Tensor], torch.Tensor], model: nn.Module) -> None:
    wrapped(_batches(1)[0]).sum().backward()  # capture and plan outside the measurements
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("policy", ["none", "memory"])
def test_accumulating_micro_batches_hold_what_plain_holds(policy: str) -> None:
    plain_model = _mlp()
    plain_peaks, plain_grads = _accumulate(plain_model, plain_model)
    model = _mlp()
    wrapped = memfit.checkpoint(model, policy)
    _warm(wrapped, model)
    peaks, grads = _accumulate(model, wrapped)
    _equal(grads, plain_grads)
    params = sum(p.nbytes for p in model.parameters())
    assert plain_peaks[1] < params / 2  # plain adds one gradient at a time into .grad
    for peak, plain in zip(peaks[1:], plain_peaks[1:]):
        assert peak <= 1.02 * plain


def test_a_step_accumulates_too_and_zeroed_grads_are_added_into() -> None:
    plain_model = _mlp()
    plain_model.zero_grad(set_to_none=False)  # grads exist, as zeros, from the first batch
    for p in plain_model.parameters():
        p.grad = torch.zeros_like(p)
    plain_peaks, plain_grads = _accumulate(plain_model, plain_model)
    model = _mlp()
    step = memfit.step(lambda x: model(x), policy="memory")
    _warm(step, model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    peaks, grads = _accumulate(model, step)
    _equal(grads, plain_grads)
    assert max(peaks) <= 1.02 * max(plain_peaks)


def test_leaves_are_checked_by_the_backwards_own_edges_not_a_view_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Which leaves the engine accumulates into is read off the running backward's node: no
    ``get_gradient_edge`` per leaf (a view of each parameter, 3.6-6.6 us, every micro-batch), and
    ``.grad`` is still plain PyTorch's bit for bit."""
    plain_model = _mlp()
    for p in plain_model.parameters():
        p.grad = torch.zeros_like(p)
    _, plain_grads = _accumulate(plain_model, plain_model)
    model = _mlp()
    wrapped = memfit.checkpoint(model, "memory")
    _warm(wrapped, model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    edges: list[torch.Tensor] = []
    original = torch.autograd.graph.get_gradient_edge

    def counted(t: torch.Tensor) -> torch.autograd.graph.GradientEdge:
        edges.append(t)
        return original(t)

    monkeypatch.setattr(torch.autograd.graph, "get_gradient_edge", counted)
    _, grads = _accumulate(model, wrapped)
    _equal(grads, plain_grads)
    assert not edges


@pytest.mark.parametrize("executor", ["eager", "inductor"])
def test_an_input_leaf_accumulates_a_non_leaf_input_is_left_to_autograd(executor: str) -> None:
    """The parameters' positions are found once per graph; an input requiring grad is checked on
    every call: a leaf input with a ``.grad`` is added into as plain PyTorch adds, and the same
    graph called with a non-leaf there (whose ``.grad`` autograd fills, ``retain_grad``) leaves it
    to autograd. Nothing noted outlives the backward: the input can be freed after it."""
    import gc
    import weakref

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    model.load_state_dict(plain.state_dict())
    wrapped = memfit.checkpoint(model, "none", executor=executor)
    tol = {"rtol": 0, "atol": 0} if executor == "eager" else {"rtol": 1e-5, "atol": 1e-6}
    data = torch.randn(4, 8)

    def run(net: Callable[[torch.Tensor], torch.Tensor], leaf: bool) -> list[torch.Tensor]:
        base = data.clone().requires_grad_()
        x = base if leaf else base * 1
        if not leaf:
            x.retain_grad()
        x.grad = torch.ones_like(x)  # an existing .grad: a leaf's to add into, not a non-leaf's
        net(x).square().sum().backward()
        assert x.grad is not None and base.grad is not None
        return [x.grad, base.grad]

    for leaf in (True, False, True):
        for got, want in zip(run(wrapped, leaf), run(plain, leaf), strict=True):
            torch.testing.assert_close(got, want, **tol)
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **tol)
    x = data.clone().requires_grad_()
    x.grad = torch.zeros_like(x)
    wrapped(x).sum().backward()
    gone = weakref.ref(x)
    del x
    gc.collect()
    assert gone() is None


def test_hooks_autograd_grad_and_backward_inputs_see_their_gradients() -> None:
    model, plain = _mlp(), _mlp()
    wrapped = memfit.checkpoint(model, "memory")
    _warm(wrapped, model)
    x, x2 = _batches(2)
    for run in (plain, wrapped):
        run(x).sum().backward()  # every .grad exists from here on
    # A tensor hook must see (and may change) the new gradient before it is accumulated.
    seen: dict[str, list[torch.Tensor]] = {"plain": [], "memfit": []}
    for key, m in (("plain", plain), ("memfit", model)):
        m[0].weight.register_hook(lambda g, key=key: seen[key].append(g.clone()) or g * 2)
    # torch.autograd.grad returns the gradients and leaves .grad alone.
    before = [p.grad.clone() for p in model.parameters()]
    got = torch.autograd.grad(wrapped(x2).sum(), list(model.parameters()))
    want = torch.autograd.grad(plain(x2).sum(), list(plain.parameters()))
    _equal(list(got), list(want))
    _equal([p.grad for p in model.parameters()], before)
    # backward(inputs=...) accumulates into the named leaves only.
    wrapped(x2).sum().backward(inputs=[model[2].weight])
    plain(x2).sum().backward(inputs=[plain[2].weight])
    _equal([p.grad for p in model.parameters()], [p.grad for p in plain.parameters()])
    # A plain backward: the hooked weight is left to autograd, the rest added in the graph.
    wrapped(x2).sum().backward()
    plain(x2).sum().backward()
    _equal([p.grad for p in model.parameters()], [p.grad for p in plain.parameters()])
    assert len(seen["memfit"]) == len(seen["plain"]) == 2  # autograd.grad, plain backward
    _equal(seen["memfit"], seen["plain"])


def test_post_accumulate_grad_hooks_run_after_the_accumulation() -> None:
    model, plain = _mlp(), _mlp()
    wrapped = memfit.checkpoint(model, "memory")
    _warm(wrapped, model)
    seen: dict[str, list[torch.Tensor]] = {"plain": [], "memfit": []}
    for key, m in (("plain", plain), ("memfit", model)):
        m[0].bias.register_post_accumulate_grad_hook(
            lambda p, key=key: seen[key].append(p.grad.clone())
        )
    for x in _batches(2):
        wrapped(x).sum().backward()
        plain(x).sum().backward()
    assert len(seen["memfit"]) == 2
    _equal(seen["memfit"], seen["plain"])


def test_the_rewritten_graph_adds_right_after_each_gradient_is_made() -> None:
    def backward(g: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        gw = g.t() @ x
        gb = g.sum(0)
        return gw, gb, None

    gm = fx.symbolic_trace(backward)
    new = accumulate_into_grads(gm, frozenset({0, 1}))
    placeholders = [n.name for n in new.graph.nodes if n.op == "placeholder"]
    assert placeholders == ["g", "x", "accumulated_grad_0", "accumulated_grad_1"]
    nodes = list(new.graph.nodes)
    adds = [n for n in nodes if n.target is torch.ops.aten.add_.Tensor]
    assert [nodes[nodes.index(a) - 1] for a in adds] == [a.args[1] for a in adds]
    g, x = torch.randn(3, 4), torch.randn(3, 5)
    w, b = torch.ones(4, 5), torch.ones(4)
    assert new(g, x, w, b) == (None, None, None)
    torch.testing.assert_close(w, 1 + g.t() @ x)
    torch.testing.assert_close(b, 1 + g.sum(0))
