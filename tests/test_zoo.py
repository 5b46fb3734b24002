"""Checks of the model zoo itself (``memfit.bench.zoo``), independent of memfit's checkpointing.

If a zoo model is broken, nondeterministic or does not compile cleanly, every memfit test
built on it fails for the wrong reason; these tests say so directly.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn

from clitools import cli_env
from memfit._compat import graph_break_reasons
from memfit.bench.zoo import (
    ZOO,
    ZooCase,
    case,
    cifar_resnet,
    densenet_block,
    lstm,
    tanh_chain,
    tanh_chain_case,
    tree_to,
    unet,
)

NAMES = [c.name for c in ZOO]


def _assert_tree_equal(a: Any, b: Any, path: str = "") -> None:
    assert type(a) is type(b), f"{path}: {type(a)} vs {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert a.requires_grad == b.requires_grad, path
        assert torch.equal(a, b), f"{path}: values differ"
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_tree_equal(x, y, f"{path}[{i}]")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _assert_tree_equal(a[k], b[k], f"{path}[{k!r}]")
    else:
        assert a == b, path


def _fwd_bwd(
    model: nn.Module, c: ZooCase, module: nn.Module | None = None, seed: int = 0
) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    """Loss and gradients of one forward+backward. ``model`` may be a compiled wrapper of
    ``module``; gradients are read from ``module`` (so names carry no ``_orig_mod.``)."""
    module = model if module is None else module
    args, kwargs = c.make_inputs()
    torch.manual_seed(seed)
    loss = c.loss(model(*args, **kwargs))
    loss.backward()
    grads = {
        n: (None if p.grad is None else p.grad.detach().clone())
        for n, p in module.named_parameters()
        if p.requires_grad
    }
    return loss.detach(), grads


def _graph_breaks() -> dict[str, int]:
    return graph_break_reasons()


# --------------------------------------------------------------------------------------
# the zoo as a collection


def test_names_unique_and_lookup() -> None:
    assert len(NAMES) == len(set(NAMES))
    assert NAMES == [
        "mlp",
        "resnet",
        "transformer",
        "unet",
        "lstm",
        "densenet",
        "dropout",
        "inplace_relu",
        "shared",
        "structured",
        "gpt2",
    ]
    for c in ZOO:
        assert case(c.name) is c
    with pytest.raises(KeyError, match="no zoo case"):
        case("nope")


@pytest.mark.slow  # a subprocess
def test_import_does_not_import_transformers() -> None:
    code = (
        "import sys; import memfit.bench.zoo; "
        "assert 'transformers' not in sys.modules, 'zoo imported transformers'"
    )
    subprocess.run([sys.executable, "-c", code], env=cli_env(), check=True)


# --------------------------------------------------------------------------------------
# per case, eager


@pytest.mark.parametrize("name", NAMES)
def test_model_is_deterministic(name: str) -> None:
    c = case(name)
    a, b = c.make_model().state_dict(), c.make_model().state_dict()
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), f"{name}: {k} differs between two make_model() calls"
    assert c.make_model().training, "zoo models are returned in training mode"


@pytest.mark.parametrize("name", NAMES)
def test_inputs_are_deterministic_and_leave_global_rng_alone(name: str) -> None:
    c = case(name)
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    first = c.make_inputs()
    assert torch.equal(before, torch.get_rng_state()), "make_inputs touched the global RNG"
    args, kwargs = first
    assert isinstance(args, tuple) and isinstance(kwargs, dict)
    _assert_tree_equal(first, c.make_inputs())


@pytest.mark.parametrize("name", NAMES)
def test_flags_match_modules(name: str) -> None:
    c = case(name)
    model = c.make_model()
    has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    has_dropout = any(
        isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()
    )
    assert c.has_batchnorm == has_bn
    assert c.has_dropout == has_dropout


@pytest.mark.parametrize("name", NAMES)
def test_eager_forward_backward(name: str) -> None:
    c = case(name)
    model = c.make_model()
    loss, grads = _fwd_bwd(model, c)
    assert loss.dim() == 0 and loss.dtype == torch.float32
    assert torch.isfinite(loss)
    assert grads, f"{name} has no trainable parameters"
    for n, g in grads.items():
        assert g is not None, f"{name}: no gradient for {n}"
        assert torch.isfinite(g).all(), f"{name}: non-finite gradient for {n}"
        assert g.abs().sum() > 0, f"{name}: gradient of {n} is all zero (unused parameter?)"


# --------------------------------------------------------------------------------------
# per case, torch.compile(backend="aot_eager")


@pytest.mark.parametrize("name", NAMES)
def test_compiles_without_graph_breaks_and_matches_eager(name: str) -> None:
    c = case(name)
    eager = c.make_model()
    loss_e, grads_e = _fwd_bwd(eager, c)

    torch.compiler.reset()
    breaks_before = _graph_breaks()
    module = c.make_model()
    compiled = torch.compile(module, backend="aot_eager", dynamic=False)
    loss_c, grads_c = _fwd_bwd(compiled, c, module=module)
    new_breaks = {
        k: v - breaks_before.get(k, 0)
        for k, v in _graph_breaks().items()
        if v != breaks_before.get(k, 0)
    }
    assert not new_breaks, f"{name}: graph breaks under dynamo: {new_breaks}"

    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    assert grads_c.keys() == grads_e.keys()
    for n in grads_e:
        torch.testing.assert_close(
            grads_c[n],
            grads_e[n],
            rtol=1e-5,
            atol=1e-6,
            msg=lambda m, n=n: f"{name}: grad of {n}: {m}",
        )
    # buffer mutation (BatchNorm running stats) must survive compilation too
    for (n, b_e), (_, b_c) in zip(eager.named_buffers(), module.named_buffers()):
        torch.testing.assert_close(
            b_c, b_e, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{name}: buffer {n}: {m}"
        )


@pytest.mark.parametrize("name", [c.name for c in ZOO if c.has_dropout])
def test_dropout_masks_same_under_compile(name: str) -> None:
    """Same seed, same masks: aot_eager keeps ``aten.native_dropout`` drawing from the
    global RNG in eager order, so compiled and eager losses agree bit for bit."""
    c = case(name)
    model = c.make_model()
    loss0, _ = _fwd_bwd(model, c, seed=0)
    loss1, _ = _fwd_bwd(c.make_model(), c, seed=1)
    assert not torch.equal(loss0, loss1), "dropout has no effect (seeds 0 and 1 agree)"

    torch.compiler.reset()
    module = c.make_model()
    compiled = torch.compile(module, backend="aot_eager", dynamic=False)
    loss0_c, _ = _fwd_bwd(compiled, c, module=module, seed=0)
    assert torch.equal(loss0_c, loss0)
    loss1_c, _ = _fwd_bwd(compiled, c, module=module, seed=1)
    assert torch.equal(loss1_c, loss1)


# --------------------------------------------------------------------------------------
# exported factories


def test_cifar_resnet_depth() -> None:
    torch.manual_seed(0)
    model = cifar_resnet(18)  # ResNet-110
    convs3 = [m for m in model.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3)]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(convs3) + len(linears) == 110
    projections = [
        m for m in model.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == (1, 1)
    ]
    assert len(projections) == 2
    small = cifar_resnet(1, width=4, num_classes=7)
    assert small(torch.randn(2, 3, 32, 32)).shape == (2, 7)


def test_unet_lstm_densenet_factories() -> None:
    torch.manual_seed(0)
    assert unet(depth=4, width=4)(torch.randn(1, 1, 32, 32)).shape == (1, 1, 32, 32)
    assert unet(depth=2, width=4, in_channels=3, out_channels=2)(
        torch.randn(1, 3, 16, 16)
    ).shape == (1, 2, 16, 16)
    assert lstm(steps=5)(torch.randn(3, 5, 16)).shape == (3, 5, 10)
    assert densenet_block(num_layers=3)(torch.randn(2, 3, 8, 8)).shape == (2, 10)


def test_tanh_chain() -> None:
    model = tanh_chain(4, 512)
    assert not list(model.parameters())
    x = model.make_input()
    assert x.shape == (512, 512) and x.numel() * x.element_size() == 2**20
    assert x.requires_grad and x.is_leaf
    out = model(x)
    ref = x.detach()
    for _ in range(4):
        ref = torch.tanh(ref)
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()

    c = tanh_chain_case(8, 64)
    (xc,), kwargs = c.make_inputs()
    assert kwargs == {} and xc.shape == (64, 64) and xc.requires_grad
    torch.compiler.reset()
    compiled = torch.compile(c.make_model(), backend="aot_eager", dynamic=False)
    loss_c = c.loss(compiled(xc))
    loss_c.backward()
    (xe,), _ = c.make_inputs()
    loss_e = c.loss(c.make_model()(xe))
    loss_e.backward()
    torch.testing.assert_close(loss_c, loss_e)
    torch.testing.assert_close(xc.grad, xe.grad)


def test_tree_to_keeps_structure() -> None:
    args, kwargs = case("structured").make_inputs()
    x = torch.ones(3, requires_grad=True)
    moved_args, moved_kwargs = tree_to((args + (x, [x]), kwargs), "meta")
    assert moved_args[0].device.type == "meta" and moved_args[0].shape == args[0].shape
    assert moved_args[1].requires_grad and moved_args[1].is_leaf
    assert isinstance(moved_args[2], list) and moved_args[2][0].device.type == "meta"
    assert moved_kwargs["mask"].dtype == torch.bool and moved_kwargs["scale"] == 0.5
