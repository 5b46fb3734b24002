"""Reading a Dynamo graph: which torch call a node is, its example value and shape, where in
the model it came from.

The pass runs before AOTAutograd, so a node is still the model's own call: ``torch.matmul``,
``operator.matmul`` and ``Tensor.matmul`` are one computation written three ways, and each set
below names them all. Part of ``memfit.capture.attention``: see its docstring.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from memfit._compat import size_hint

__all__ = [
    "ADD",
    "CASTS",
    "DIV",
    "DROPOUT",
    "FILL",
    "LINEAR",
    "MATMUL",
    "MUL",
    "SDPA_CALL",
    "SOFTMAX",
    "SQUEEZE",
    "TANH",
    "UNSQUEEZE",
    "WHERE",
    "Calls",
    "argument",
    "constant",
    "erase_unused",
    "fed_by",
    "is_call",
    "is_cast",
    "location",
    "shape_of",
    "shown",
    "size_args",
    "value_of",
]

#: The torch functions and the Tensor method names that compute one thing.
Calls = tuple[tuple[Callable[..., Any], ...], tuple[str, ...]]


def is_call(node: Any, calls: Calls) -> bool:
    if not isinstance(node, fx.Node):
        return False
    functions, methods = calls
    if node.op == "call_function":
        return node.target in functions
    return node.op == "call_method" and node.target in methods


MATMUL: Calls = (
    (torch.matmul, operator.matmul, torch.bmm, torch.Tensor.matmul),
    ("matmul", "bmm"),
)
SOFTMAX: Calls = (
    (F.softmax, torch.softmax, torch.special.softmax, torch.Tensor.softmax),
    ("softmax",),
)
DROPOUT: Calls = ((F.dropout, torch.dropout), ())
MUL: Calls = ((operator.mul, operator.imul, torch.mul), ("mul",))
DIV: Calls = (
    (operator.truediv, operator.itruediv, torch.div, torch.true_divide),
    ("div", "true_divide"),
)
ADD: Calls = ((operator.add, operator.iadd, torch.add), ("add",))
FILL: Calls = ((torch.masked_fill,), ("masked_fill",))
WHERE: Calls = ((torch.where,), ())
SDPA_CALL: Calls = ((F.scaled_dot_product_attention,), ())
TANH: Calls = ((torch.tanh, F.tanh, torch.Tensor.tanh), ("tanh",))
LINEAR: Calls = ((F.linear,), ())
SQUEEZE: Calls = ((torch.squeeze,), ("squeeze",))
UNSQUEEZE: Calls = ((torch.unsqueeze,), ("unsqueeze",))
CASTS = {"float", "double", "half", "bfloat16", "to", "type", "type_as", "contiguous"}


def value_of(node: Any) -> Any:
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


def shape_of(node: Any) -> tuple[int, ...] | None:
    """The node's shape; sizes captured as symbols stay SymInts (``int()`` would specialize the
    graph to this call's size: comparing two of the same symbol needs no guard)."""
    value = value_of(node)
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def shown(shape: Any) -> tuple[int, ...]:
    """A shape for ``AttentionSite``: symbolic sizes at the sizes of the call captured."""
    return tuple(size_hint(s) for s in shape)


def size_args(
    graph: fx.Graph, shape: tuple[Any, ...], sources: list[tuple[fx.Node, int]]
) -> list[Any]:
    """``shape`` as graph arguments: an int where the size is static, else the size read from
    ``sources[i]`` (a node and dim of that size), so the rewritten graph holds at every size."""
    out: list[Any] = []
    for s, (node, dim) in zip(shape, sources, strict=True):
        out.append(s if isinstance(s, int) else graph.call_method("size", (node, dim)))
    return out


def argument(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def is_cast(node: Any) -> bool:
    """A dtype cast (or ``contiguous``): the kernel computes in fp32 whatever the model cast."""
    if not (isinstance(node, fx.Node) and node.op == "call_method" and node.target in CASTS):
        return False
    extra = list(node.args[1:]) + [v for k, v in node.kwargs.items() if k in ("dtype", "other")]
    for a in extra:
        if isinstance(a, torch.dtype):
            if not a.is_floating_point:
                return False
        elif not (isinstance(a, fx.Node) and isinstance(value_of(a), torch.Tensor)):
            return False  # a device or a string: not a plain cast
    return not any(k in node.kwargs for k in ("device", "copy"))


def constant(arg: Any) -> float | None:
    """A Python number, or a 0-dim tensor made in the graph from one (``torch.full([], v)``)."""
    if isinstance(arg, bool):
        return None
    if isinstance(arg, (int, float)):
        return float(arg)
    if isinstance(arg, fx.Node) and arg.op == "call_function" and arg.target is torch.full:
        size, fill = argument(arg, 0, "size"), argument(arg, 1, "fill_value")
        if tuple(size) == () and isinstance(fill, (int, float)) and not isinstance(fill, bool):
            return float(fill)
    return None


def location(node: fx.Node) -> str:
    """The model's submodule (as in ``named_modules()``) and source line of a node."""
    stack = node.meta.get("nn_module_stack") or {}
    module = "model"
    if stack:
        path, kind = list(stack.values())[-1]
        name = re.sub(r"^L\['[^']*'\]\.?|^L__[a-z]+__\.?", "", str(path))
        name = re.sub(r"_modules\['([^']*)'\]", r"\1", name).replace("['", ".").replace("']", "")
        module = name or getattr(kind, "__name__", str(kind))
    found = re.findall(r'File "([^"]+)", line (\d+)', node.meta.get("stack_trace") or "")
    return f"{module} ({found[-1][0].rsplit('/', 1)[-1]}:{found[-1][1]})" if found else module


def erase_unused(graph: fx.Graph, chain: list[fx.Node]) -> None:
    """Erase the replaced nodes, last first, so each one's readers are gone when it is reached."""
    position = {node: i for i, node in enumerate(graph.nodes)}
    for node in sorted(chain, key=position.__getitem__, reverse=True):
        if not node.users:
            graph.erase_node(node)


def fed_by(softmax: fx.Node, calls: Calls, depth: int = 6) -> bool:
    """Whether ``calls`` computes the softmax's input within ``depth`` ops: a softmax fed by a
    matmul (or a tanh, for additive attention) is worth reporting when it is left alone."""
    level: list[Any] = [argument(softmax, 0, "input")]
    for _ in range(depth):
        if any(is_call(node, calls) for node in level):
            return True
        level = [a for node in level if isinstance(node, fx.Node) for a in node.all_input_nodes]
    return False
