"""ATen ops as an FX graph holds them: the schema of an op, which says how it treats its
arguments (which it writes, which its results alias).
"""

from __future__ import annotations

from typing import Any, overload

import torch
from torch._ops import OpOverload

__all__ = [
    "op_schema",
]


# ---- an op's schema (checked 2.13.0) -------------------------------------------------------------
@overload
def op_schema(target: OpOverload) -> torch.FunctionSchema: ...


@overload
def op_schema(target: Any) -> torch.FunctionSchema | None: ...


def op_schema(target: Any) -> torch.FunctionSchema | None:
    """The schema of a graph node's target where it is an ATen op (``OpOverload._schema``,
    checked 2.13.0; torch has no public name for it), None for Python glue without one
    (``operator.getitem``).

    memfit reads from it whether an op writes an input (``is_mutable``, an argument's
    ``alias_info.is_write``), whether a result is a view (a return's ``alias_info``), and the
    op's name and argument names.
    """
    return getattr(target, "_schema", None)
