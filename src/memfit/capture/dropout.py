"""Dropout as eager CPU runs it: dropouts that do nothing leave the Dynamo graph before AOTAutograd
sees them, and a CPU dropout's backward multiplies by eager's rounded scale.

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
the same masks and forward, but in bf16 or fp16 a backward up to one rounding step apart (bf16
autocast around Linear -> Dropout -> Linear: weight gradients 1.5e-5 off plain PyTorch's).
``eager_cpu_dropout_backward`` writes the backward as eager computes it, op for op.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from memfit.capture.edit import bypass, recompiled

__all__ = ["eager_cpu_dropout_backward", "remove_identity_dropouts"]

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
