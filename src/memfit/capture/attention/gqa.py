"""Key and value heads repeated for grouped-query attention, found before an SDPA call.

Why: a model with fewer key/value heads than query heads repeats its keys and values to the
query's head count before SDPA (HuggingFace's ``repeat_kv``: ``x[:, :, None].expand(...)
.reshape(...)``) unless SDPA can do it itself (``enable_gqa=True``). HuggingFace takes
``enable_gqa`` only when no mask is passed, and under Dynamo a padding mask is a traced tensor it
cannot skip, so the captured graph repeats: SDPA's backward then keeps the repeated copies, n_rep
times the keys and values eager autograd keeps (Llama, width 256, 8 query and 2 key/value heads,
batch 8 x 128: 1.5 MiB more per layer). Passing the unrepeated tensors with ``enable_gqa=True``
computes the same attention (CPU flash attention takes a mask with it); the keys' and values'
gradients are summed over the group inside the kernel instead of by ``expand``'s backward, so
they equal the repeated form's to floating-point rounding, as every rewrite of this pass does.

Part of ``memfit.capture.attention``: see its docstring.
"""

from __future__ import annotations

import operator
from typing import Any

import torch.fx as fx

from memfit.capture.attention.dynamo_nodes import UNSQUEEZE, argument, is_call, shape_of

__all__ = ["repeated_heads"]

_FULL = slice(None, None, None)


def _inserts_dim_2(node: fx.Node) -> fx.Node | None:
    """The tensor ``node`` adds a size-1 dim 2 to (``x[:, :, None]`` or ``x.unsqueeze(2)``)."""
    if node.op == "call_function" and node.target is operator.getitem:
        base, index = node.args[0], node.args[1]
        if isinstance(base, fx.Node) and isinstance(index, tuple) and len(index) >= 3:
            if index[:3] == (_FULL, _FULL, None) and all(
                i == _FULL or i is Ellipsis for i in index[3:]
            ):
                return base
        return None
    if is_call(node, UNSQUEEZE) and argument(node, 1, "dim") == 2:
        base = argument(node, 0, "input")
        return base if isinstance(base, fx.Node) else None
    return None


def repeated_heads(node: Any) -> tuple[fx.Node, int] | None:
    """``(x, n_rep)`` when ``node`` is ``x`` [B, H, L, D] with each head repeated ``n_rep``
    times in place (``repeat_kv``: unsqueeze at dim 2, expand, reshape to [B, H * n_rep, L, D]),
    else None."""
    if not (
        isinstance(node, fx.Node)
        and node.op == "call_method"
        and node.target in ("reshape", "view")
        and isinstance(node.args[0], fx.Node)
    ):
        return None
    expand = node.args[0]
    if not (expand.op == "call_method" and expand.target == "expand"):
        return None
    inserted = expand.args[0]
    base = _inserts_dim_2(inserted) if isinstance(inserted, fx.Node) else None
    shapes = [shape_of(n) for n in (base, inserted, expand, node)]
    if base is None or any(s is None for s in shapes):
        return None
    x, one, wide, out = shapes
    assert x is not None and one is not None and wide is not None and out is not None
    if len(x) != 4 or len(wide) != 5 or len(out) != 4 or one[2] != 1:
        return None
    b, h, length, d = x
    n_rep = wide[2]
    if (wide[0], wide[1], wide[3], wide[4]) != (b, h, length, d):
        return None
    if tuple(out) != (b, h * n_rep, length, d) or not isinstance(n_rep, int) or n_rep < 1:
        return None
    return base, n_rep
