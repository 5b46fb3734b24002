"""``memfit.mark(tensor)``: name a tensor to keep for backward (the ``"collection"`` policy).

Why a custom op: a mark must survive Dynamo and AOTAutograd tracing and arrive in the joint graph
as a node the partitioner can see. Outside of capture (plain eager calls, the oracle runs in the
tests) ``mark`` is the identity and costs nothing. Inside capture it becomes ``memfit::mark``;
before partitioning, memfit removes every mark node, rewires its readers to the marked value and
tags that value, so the mark itself never runs. Its eager kernel (a copy, since custom ops may not
return an alias of an input) only runs if somebody compiles a model containing marks with a
backend other than memfit's.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from memfit.capture.edit import bypass, recompiled

__all__ = ["mark", "strip_marks"]

MARK_META = "memfit_marked"


@torch.library.custom_op("memfit::mark", mutates_args=())
def _mark_op(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_mark_op.register_fake
def _mark_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _mark_backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
    return grad


_mark_op.register_autograd(_mark_backward)


def mark(tensor: torch.Tensor) -> torch.Tensor:
    """Mark ``tensor`` to be kept for backward under the ``"collection"`` policy; returns it.

    Use the returned value (``h = memfit.mark(h)``), as with any function inside a traced model.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"memfit.mark expects a torch.Tensor, got {type(tensor).__name__}; "
            "mark each tensor of a structure separately"
        )
    if torch.compiler.is_compiling():
        return _mark_op(tensor)
    return tensor


def strip_marks(gm: fx.GraphModule) -> int:
    """Remove ``memfit::mark`` nodes from ``gm``, tagging their inputs; returns how many."""
    count = 0
    target = torch.ops.memfit.mark.default
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is target:
            src = node.args[0]
            assert isinstance(src, fx.Node)
            src.meta[MARK_META] = True
            bypass(node, src)
            count += 1
    return recompiled(gm, count)
