"""Dropouts that do nothing leave the Dynamo graph before AOTAutograd sees them.

Eager PyTorch returns a dropout's input itself when ``p == 0`` or ``training`` is false (ATen's
``_dropout_impl``): no new tensor. AOTAutograd's decomposition of ``aten.dropout`` returns
``input.clone()`` there instead, so the joint graph gets a copy eager never makes; where the next op
saves its input for backward (``linear2`` after ``dropout(relu(...))`` in ``nn.TransformerEncoder``
built with ``dropout=0.0``, or the attention matmul after HF's ``dropout(attn_weights, p=0.0)``),
the copy is kept besides the original and ``"none"`` kept more than eager autograd (measured on
the zoo transformer: +4 MiB at batch 32 x 128, 1.15x eager's peak). Replacing such a call by its
input is exactly what eager does.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from memfit.capture.edit import bypass, recompiled

__all__ = ["remove_identity_dropouts"]

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
