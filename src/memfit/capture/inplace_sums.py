"""Gradient sums made in place, as eager autograd makes them.

Where a value feeds several ops, its gradient is a sum: eager autograd's ``InputBuffer`` adds each
new part into the buffer it holds (``old.add_(new)``, when it holds the last reference to a
plain dense tensor), so a sum of K parts keeps two full-size tensors alive at a time. A traced
backward graph writes the sum out of place, ``add(acc, part)``, so for an instant it holds three:
the old sum, the part and the new sum. On HF Mamba's sequential scan (64 steps, each adding a
``select_backward`` of the whole [batch, channels, length, state] tensor) that one extra tensor
put memfit's ``"none"`` 0.5 MB (9%) above plain PyTorch's peak; every residual connection and
every weight shared by two ops makes such a sum.

``inplace_sums`` finds the sums that can reuse an operand's buffer exactly where eager would: an
out-of-place ``add`` whose operand is a gradient (computed from a tangent) that nothing else
reads, has the sum's shape, dtype and strides, and owns its whole storage alone.
``mark_inplace_sums`` tags them in a joint graph (the eager executor's only: Inductor plans its
own buffers); the simulator counts a tagged sum in that operand's storage (``analysis.graph``)
and the eager executor runs it as ``add_`` on it (``execution.split``, ``run_inplace_sums``):
the same bits (IEEE addition commutes), one tensor fewer.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch
import torch.fx as fx

from memfit._compat import StorageWeakRef, is_tangent, op_schema

__all__ = ["INPLACE_OPERAND", "inplace_sums", "mark_inplace_sums", "run_inplace_sums"]

#: ``node.meta`` key of a sum made in place: the index of the operand that takes it
INPLACE_OPERAND = "memfit_inplace_operand"

_ADD = torch.ops.aten.add.Tensor


def _storage(t: torch.Tensor) -> object | None:
    try:
        return StorageWeakRef(t.untyped_storage())
    except (NotImplementedError, RuntimeError):
        return None


def _is_view(node: fx.Node) -> bool:
    """An ATen op whose result aliases an input, per its schema (``analysis.graph.is_view_op``,
    which imports this module)."""
    schema = op_schema(node.target)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def _static(t: torch.Tensor) -> bool:
    return all(isinstance(d, int) for d in (*t.shape, *t.stride(), t.storage_offset()))


def _owns_its_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` is its whole storage, from offset 0, densely."""
    try:
        nbytes = t.untyped_storage().nbytes()
    except (NotImplementedError, RuntimeError):
        return False
    return t.storage_offset() == 0 and t.is_contiguous() and nbytes == t.numel() * t.element_size()


def mark_inplace_sums(joint: fx.GraphModule) -> int:
    """Tag, in a joint graph, each sum that can be made in place; returns how many."""
    found = inplace_sums(joint.graph.nodes)
    for total, operand in found.items():
        total.meta[INPLACE_OPERAND] = total.args.index(operand)
    return len(found)


def run_inplace_sums(bw: fx.GraphModule) -> int:
    """Make the tagged sums of a backward graph split from a tagged joint graph in place, where
    the operand is still read by the sum alone; returns how many."""
    changed = 0
    for n in bw.graph.nodes:
        index = n.meta.get(INPLACE_OPERAND)
        if index is None or n.target is not _ADD:
            continue
        operand = n.args[index]
        if not isinstance(operand, fx.Node) or len(operand.users) != 1:
            continue
        n.target = torch.ops.aten.add_.Tensor
        n.args = (operand, n.args[1 - index])
        changed += 1
    if changed:
        bw.recompile()
    return changed


def inplace_sums(nodes: Iterable[fx.Node]) -> dict[fx.Node, fx.Node]:
    """The out-of-place ``add`` nodes of a backward (or joint) graph that can be made in place,
    each with the operand whose buffer takes the sum (see the module docstring)."""
    nodes = list(nodes)
    gradients: set[fx.Node] = set()
    holders: Counter[object] = Counter()
    for n in nodes:
        if is_tangent(n) or (
            n.op == "call_function" and any(a in gradients for a in n.all_input_nodes)
        ):
            gradients.add(n)
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            key = _storage(val)
            if key is not None:
                holders[key] += 1
    found: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        if n.op != "call_function" or n.target is not _ADD or len(n.args) != 2:
            continue
        if n.kwargs.get("alpha", 1) != 1 or set(n.kwargs) - {"alpha"}:
            continue
        out = n.meta.get("val")
        if not isinstance(out, torch.Tensor) or not _static(out):
            continue
        for x in n.args:
            if not (
                isinstance(x, fx.Node)
                and x.op == "call_function"
                and x in gradients
                and len(x.users) == 1
                and n.args.count(x) == 1
                and not _is_view(x)
            ):
                continue
            val = x.meta.get("val")
            if not (
                isinstance(val, torch.Tensor)
                and _static(val)
                and val.shape == out.shape
                and val.stride() == out.stride()
                and val.dtype == out.dtype
                and val.device == out.device
                and _owns_its_storage(val)
                and holders[_storage(val)] == 1
            ):
                continue
            found[n] = x
            break
    return found
