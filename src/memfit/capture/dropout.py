"""Dropout as eager CPU runs it: dropouts that do nothing leave the Dynamo graph before AOTAutograd
sees them, a CPU dropout's backward multiplies by eager's rounded scale, and its result is made
from its mask by an op a plan can recompute.

Eager PyTorch returns a dropout's input itself when ``p == 0`` or ``training`` is false (ATen's
``_dropout_impl``): no new tensor. AOTAutograd's decomposition of ``aten.dropout`` returns
``input.clone()`` there instead, so the joint graph gets a copy eager never makes; where the next op
saves its input for backward (``linear2`` after ``dropout(relu(...))`` in ``nn.TransformerEncoder``
built with ``dropout=0.0``, or the attention matmul after HF's ``dropout(attn_weights, p=0.0)``),
the copy is kept besides the original and ``"none"`` kept more than eager autograd (measured on
the zoo transformer: +4 MiB at batch 32 x 128, 1.15x eager's peak). Replacing such a call by its
input is exactly what eager does.

Eager CPU ``F.dropout`` never calls ``native_dropout`` (ATen's fused kernel is for CUDA): it draws
``noise = empty_like(x).bernoulli_(1 - p)`` in ``x``'s dtype, divides it by ``1 - p`` in place and
returns ``x * noise``, so its backward is ``grad * noise``, the scale rounded to ``x``'s dtype. A
traced graph's ``native_dropout_backward(grad, mask, scale)`` multiplies by the unrounded scale:
the same masks, but in bf16 or fp16 a backward up to one rounding step apart (bf16
autocast around Linear -> Dropout -> Linear: weight gradients 1.5e-5 off plain PyTorch's).
``eager_cpu_dropout_backward`` writes the backward as eager computes it, op for op.

NOTE [A dropout's result, made again from its mask]
    A traced ``native_dropout`` returns its result and its mask from one random op, and random
    ops are never recomputed (a second draw would not give the same mask), so every plan kept
    every dropout's result, however cheap it is to make again from its input and the 1-byte
    mask. HF's checkpointing keeps neither (it replays the random state and draws again): on
    XGLM, whose attention dropout acts on [batch x heads, L, L] fp32 probabilities, memfit's
    ``"memory"`` kept each layer's dropped probabilities and peaked above HF's per-layer
    checkpointing (3,110,284 bytes against 2,876,124 at batch 2 x 64).
    ``recomputable_cpu_dropout`` leaves ``native_dropout`` to draw the mask (the kernel's own
    draw: the same samples, the generator left where eager leaves it; its own result dies as it
    is made) and hands its readers ``memfit::dropout_result(x, mask, s)``, which a plan may keep
    or recompute (there: 2,776,856 bytes, predicted to the byte). That op computes
    ``x.mul(mask).mul_(s)``, the CPU kernel's own expression, so NaN, infinities and signed
    zeros come out as eager's (``where(mask, x, 0) * s`` made a dropped NaN 0 and a dropped -x
    +0), and it holds what the kernel holds: the mask cast to ``x``'s dtype while it multiplies,
    then the product, scaled in place. Why one op: as ``mul`` and an in-place ``mul_`` in the
    graph, the product in between would be a forward value a plan could keep, and a kept value
    cannot be scaled in place; ``native_dropout_backward(x, mask, s)`` computes the same bits
    but scales out of place, a wrapped scalar (12 bytes) above the kernel at its peak.
    ``s`` is ``1 / (1 - p)`` rounded as eager's ``noise.div_(1 - p)`` rounds it, in ``x``'s
    dtype: the kernel multiplies by the unrounded double, which in fp32 is a rounding step off
    eager's scale for some ``p`` (0.15, 0.123: there the traced forward differed from eager's in
    the last bit of kept elements, and so did the gradients), so the rebuilt result is eager's
    bit for bit in fp32, fp64, bf16 and fp16 (``tests/test_dropout.py``).
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor

from memfit._compat import disable_current_modes
from memfit.capture.edit import bypass, recompiled

__all__ = [
    "dropout_result",
    "eager_cpu_dropout_backward",
    "eager_dropout_scale",
    "recomputable_cpu_dropout",
    "remove_identity_dropouts",
]

_aten = torch.ops.aten

#: Functional dropouts (``input, p, training, inplace``), bound by their own signatures.
_FUNCTIONAL: tuple[Callable[..., Any], ...] = (
    F.dropout,
    F.dropout1d,
    F.dropout2d,
    F.dropout3d,
    F.alpha_dropout,
    F.feature_alpha_dropout,
)
#: ATen's (``input, p, train``), all arguments required.
_ATEN: tuple[Callable[..., Any], ...] = (
    torch.dropout,
    torch.feature_dropout,
    torch.alpha_dropout,
    torch.feature_alpha_dropout,
)


def _p_and_training(node: fx.Node) -> tuple[Any, Any] | None:
    if node.target in _FUNCTIONAL:
        try:
            bound = inspect.signature(node.target).bind(*node.args, **node.kwargs)
        except TypeError:
            return None
        bound.apply_defaults()
        return bound.arguments["p"], bound.arguments["training"]
    if node.target in _ATEN:
        names = ("input", "p", "train")
        args = dict(zip(names, node.args)) | dict(node.kwargs)
        if not set(names) <= args.keys():
            return None
        return args["p"], args["train"]
    return None


def remove_identity_dropouts(gm: fx.GraphModule) -> int:
    """Replace, in a Dynamo graph, each dropout with ``p == 0`` or ``training=False`` by its input.

    Only constant arguments count (a computed ``p`` or flag is left alone). Returns how many were
    removed.
    """
    removed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        found = _p_and_training(node)
        if found is None:
            continue
        p, training = found
        constant_p = isinstance(p, (int, float)) and not isinstance(p, bool)
        if not ((constant_p and p == 0) or training is False):
            continue
        source = node.args[0] if node.args else node.kwargs.get("input")
        if not isinstance(source, fx.Node):
            continue
        bypass(node, source)
        removed += 1
    return recompiled(gm, removed)


def _keep_probability(mask: fx.Node, scale: float) -> float:
    """``1 - p`` as eager divides by it: the ``p`` of the ``native_dropout`` that drew ``mask``
    where the graph shows it, else ``1 / scale`` (the same float32 and bf16 value)."""
    source = mask.args[0] if mask.target is operator.getitem else None
    if isinstance(source, fx.Node) and source.target is _aten.native_dropout.default:
        p = source.args[1]
        if isinstance(p, (int, float)):
            return 1.0 - float(p)
    return 1.0 / scale


def eager_cpu_dropout_backward(joint: fx.GraphModule) -> int:
    """Replace, in a joint graph, each CPU ``native_dropout_backward(grad, mask, scale)`` by eager's
    ``grad * (mask.to(grad.dtype) / (1 - p))`` (see the module docstring). Returns how many."""
    replaced = 0
    for node in list(joint.graph.nodes):
        if node.target is not _aten.native_dropout_backward.default:
            continue
        grad, mask, scale = node.args[:3]
        val = node.meta.get("val")
        if not (
            isinstance(grad, fx.Node)
            and isinstance(mask, fx.Node)
            and isinstance(scale, (int, float))
            and scale != 0
            and isinstance(val, torch.Tensor)
            and val.device.type == "cpu"
        ):
            continue
        keep = _keep_probability(mask, float(scale))
        meta = {k: v for k, v in node.meta.items() if k != "val"}
        graph = joint.graph
        with graph.inserting_before(node):
            cast = graph.call_function(_aten._to_copy.default, (mask,), {"dtype": val.dtype})
            noise = graph.call_function(_aten.div.Tensor, (cast, keep))
            product = graph.call_function(_aten.mul.Tensor, (grad, noise))
        # the values' metadata: the mask's (fake) tensor cast and divided in its own fake mode,
        # the product the gradient the replaced op made
        cast_val = mask.meta["val"].to(val.dtype)
        noise_val = cast_val / keep
        product_val = val
        for new, value in ((cast, cast_val), (noise, noise_val), (product, product_val)):
            new.meta = dict(meta, val=value)
        bypass(node, product)
        replaced += 1
    return recompiled(joint, replaced)


def eager_dropout_scale(p: float, dtype: torch.dtype) -> float:
    """``1 / (1 - p)`` as eager CPU ``F.dropout`` multiplies by it: ``noise.div_(1 - p)`` on a
    noise of ones in ``dtype``, so rounded to ``dtype`` (see the NOTE above). Computed on a real
    tensor, also where the caller traces under a fake mode (AOTAutograd's partitioner)."""
    with disable_current_modes():
        return float(torch.ones((), dtype=dtype).div_(1.0 - p))


@torch.library.custom_op("memfit::dropout_result", mutates_args=())
def dropout_result(x: Tensor, mask: Tensor, scale: float) -> Tensor:
    """``x.mul(mask).mul_(scale)``: a dropout's result from its input and its bool ``mask``, as
    the CPU ``native_dropout`` kernel computes it; the mask cast to ``x``'s dtype is its scratch."""
    return x.mul(mask).mul_(scale)


@dropout_result.register_fake
def _dropout_result_fake(x: Tensor, mask: Tensor, scale: float) -> Tensor:
    return x.mul(mask)  # the layout and dtype the real kernel's product gets


def recomputable_cpu_dropout(joint: fx.GraphModule) -> int:
    """Hand, in a joint graph, the readers of each CPU ``native_dropout(x, p, train)``'s result
    ``memfit::dropout_result(x, mask, s)`` instead, which a plan can recompute (see the NOTE
    above). Returns how many dropouts were rewritten."""
    rewritten = 0
    graph = joint.graph
    for node in list(graph.nodes):
        if node.target is not _aten.native_dropout.default or len(node.args) < 2:
            continue
        x, p = node.args[:2]
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train")
        val = node.meta.get("val")
        x_val = x.meta.get("val") if isinstance(x, fx.Node) else None
        if not (
            isinstance(x_val, torch.Tensor)
            and x_val.device.type == "cpu"
            and x_val.is_floating_point()
            and isinstance(p, float)
            and 0.0 < p < 1.0
            and train in (True, None)
            and isinstance(val, (tuple, list))
            and all(u.target is operator.getitem for u in node.users)
        ):
            continue
        results = [u for u in node.users if u.args[1] == 0]
        if not results:
            continue
        masks = [u for u in node.users if u.args[1] == 1]
        meta = {k: v for k, v in node.meta.items() if k != "val"}
        with graph.inserting_after(node):
            mask = masks[0] if masks else graph.call_function(operator.getitem, (node, 1))
        scale = eager_dropout_scale(p, x_val.dtype)
        with graph.inserting_after(mask):
            result = graph.call_function(torch.ops.memfit.dropout_result.default, (x, mask, scale))
        if not masks:
            mask.meta = dict(meta, val=val[1])
        # The readers' values (views of the result among them) were traced from the kernel's
        # result: that fake tensor becomes the rebuilt result's, and the kernel's own result,
        # which dies as it is made, a storage of its own.
        result.meta = dict(meta, val=val[0])
        node.meta["val"] = (torch.empty_like(val[0]), val[1])
        for old in results:
            bypass(old, result)
        rewritten += 1
    return recompiled(joint, rewritten)
