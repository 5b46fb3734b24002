"""Symbolic sizes: hints, expressions and symbols of SymInts, and dense memory formats."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

__all__ = [
    "dense_memory_format",
    "is_sym_node",
    "size_expr",
    "size_hint",
    "size_symbols",
]

# ---- symbolic sizes (checked 2.13.0) -------------------------------------------------------------
# A graph captured with dynamic shapes carries SymInts (a sympy expression over the shape
# environment's symbols, with a hint: the value at capture) wherever a size varies. Reading one as
# ``int(...)`` asks the shape environment to *guard* on its value, which specializes the graph to
# that size; memfit's estimates (bytes, FLOPs) must read hints instead, and its per-size
# predictions substitute sizes into the expressions. ``torch.fx.experimental.symbolic_shapes``
# is where torch keeps these helpers; it is not underscored but documented as experimental.
from torch.fx.experimental.symbolic_shapes import free_symbols as _free_symbols  # noqa: E402
from torch.fx.experimental.symbolic_shapes import optimization_hint as _optimization_hint  # noqa: E402


def size_hint(value: Any) -> int:
    """``value`` (an int or SymInt) at the sizes it was captured with, adding no guard.

    ``optimization_hint`` is torch's own "for memory estimation" reading of a size (checked
    2.13.0); a plain ``int(symint)`` would guard on the value and specialize the graph.
    """
    if isinstance(value, torch.SymInt):
        return int(_optimization_hint(value))
    return int(value)


def size_expr(value: Any) -> Any:
    """The sympy expression behind a SymInt (``value.node.expr``), or the int itself."""
    if isinstance(value, torch.SymInt):
        return value.node.expr
    return int(value)


def size_symbols(value: Any) -> set[Any]:
    """The shape symbols a value (SymInt, tensor, or a nest of them) depends on."""
    return set(_free_symbols(value))


def is_sym_node(node: fx.Node) -> bool:
    """A node whose value is a symbolic int, float or bool (a size computed in the graph)."""
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))


#: Dense layouts a tensor can have by name, tried in this order: a tensor with a size-1 dimension
#: can be several at once, and eager's default comes first.
_DENSE_FORMATS = (torch.contiguous_format, torch.channels_last, torch.channels_last_3d)


def dense_memory_format(value: torch.Tensor) -> torch.memory_format | None:
    """The memory format ``value``'s strides are (contiguous, channels-last), or None if none.

    ``torch._prims_common.is_contiguous_for_memory_format_or_false`` (checked 2.13.0): it answers
    False rather than guard where a stride holds a size symbol.
    """
    from torch._prims_common import is_contiguous_for_memory_format_or_false

    for memory_format in _DENSE_FORMATS:
        if is_contiguous_for_memory_format_or_false(value, memory_format=memory_format):
            return memory_format
    return None
