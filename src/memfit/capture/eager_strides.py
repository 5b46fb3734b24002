"""Strides as eager's kernels make them, so a traced backward copies only where eager copies.

Tracing chooses between a view and a copy by the strides of fake tensors: ``reshape`` is traced
as ``view`` where the fake layout allows one and as ``clone`` + ``_unsafe_view`` where it does
not, ``.contiguous()`` as a ``clone`` where the fake tensor is not contiguous. A few ATen ops'
fake implementations (torch's Python decompositions, run as their meta) give an output other
strides than their kernel does. CPU ``native_layer_norm_backward`` returns the input gradient
contiguous (ATen makes ``dX`` like the contiguous input); its decomposition gives it the layout
of the incoming gradient. Where that gradient arrives transposed (Swin's pooler reads
``layernorm(h).transpose(1, 2)``, as ViT-style poolers do), the traced backward copies the
layer norm's input gradient before the next linear's backward, every elementwise op below
inherits the transposed layout, and each later ``reshape`` copies again: eager copies none of
them. On tiny Swin (batch 2 x 32 x 32 images) those copies put memfit's ``"none"`` at 285,464
bytes against plain PyTorch's 283,040; the copy is the size of the gradient it copies, so the
excess grows with the batch and the width.

``eager_strides`` corrects a joint graph where it is wrong: the outputs :data:`EAGER_CONTIGUOUS`
names take the layout their kernel gives, every value computed from them is traced again on fake
tensors (its strides and, for a view, its storage follow), and a copy made only because a fake
layout was wrong becomes what eager runs: ``clone(x, memory_format=contiguous_format)`` of an
``x`` now contiguous becomes ``aten.contiguous(x)``, and an ``_unsafe_view`` of it a ``view``.
``contiguous`` copies where its input is not contiguous, so the step stays right whatever the
real strides are; only the prediction rests on the table. The eager executor's graphs only:
Inductor chooses its own layouts.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from memfit._compat import OpOverload, op_schema, tree_map
from memfit.capture.edit import recompiled

__all__ = ["EAGER_CONTIGUOUS", "eager_strides"]

_aten = torch.ops.aten

#: Ops whose kernel on a device type returns outputs contiguous whatever their inputs' strides,
#: where torch's fake implementation follows an input's layout instead: op -> device type ->
#: indices of those outputs. Checked against the kernels on torch 2.13 CPU
#: (``tests/test_eager_strides.py`` runs each one on a transposed gradient).
EAGER_CONTIGUOUS: dict[OpOverload, dict[str, tuple[int, ...]]] = {
    # dX = empty_like(*X.expect_contiguous()): the decomposition's follows grad_out
    _aten.native_layer_norm_backward.default: {"cpu": (0,)},
    # grad_input made contiguous (host_softmax_backward); the decomposition's follows grad_output
    _aten._log_softmax_backward_data.default: {"cpu": (0,)},
}

_CLONE = _aten.clone.default
_UNSAFE_VIEW = _aten._unsafe_view.default


def _static(t: torch.Tensor) -> bool:
    return all(isinstance(d, int) for d in (*t.shape, *t.stride(), t.storage_offset()))


def _contiguous(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and _static(t) and t.is_contiguous()


def _eager_layout(node: fx.Node) -> Any | None:
    """``node``'s value with the layout its kernel gives (:data:`EAGER_CONTIGUOUS`), or None
    where its fake value already has it."""
    val = node.meta.get("val")
    outputs = list(val) if isinstance(val, (tuple, list)) else [val]
    changed = False
    for i in EAGER_CONTIGUOUS[node.target].get(_device_type(outputs), ()):  # type: ignore[index]
        t = outputs[i] if i < len(outputs) else None
        if isinstance(t, torch.Tensor) and _static(t) and not t.is_contiguous():
            outputs[i] = torch.empty_like(t, memory_format=torch.contiguous_format)
            changed = True
    if not changed:
        return None
    return type(val)(outputs) if isinstance(val, (tuple, list)) else outputs[0]


def _device_type(values: list[Any]) -> str:
    return next((v.device.type for v in values if isinstance(v, torch.Tensor)), "")


def _same_layout(a: Any, b: Any) -> bool:
    """Whether two values (tensors or tuples of them) have the same sizes and strides."""
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_layout(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (
            a.shape == b.shape
            and a.stride() == b.stride()
            and a.storage_offset() == b.storage_offset()
        )
    return not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor)


def _aliases(node: fx.Node) -> bool:
    """Whether ``node``'s value shares its input's storage: a view by its schema, or an output
    of a multi-output op taken out."""
    if node.target is operator.getitem:
        return True
    schema = op_schema(node.target)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def eager_strides(joint: fx.GraphModule) -> int:
    """Give, in place, a joint graph's values the layouts eager's kernels give them and drop the
    copies the fake layouts made (see the module docstring); returns how many copies became
    views. A value that cannot be traced again leaves the graph as it was."""
    vals: dict[fx.Node, Any] = {}
    targets: dict[fx.Node, OpOverload] = {}
    for n in joint.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target in EAGER_CONTIGUOUS:
            val = _eager_layout(n)
            if val is not None:
                vals[n] = val
            continue
        if not any(a in vals for a in n.all_input_nodes):
            continue
        args, kwargs = tree_map(
            lambda a: vals.get(a, a.meta.get("val")) if isinstance(a, fx.Node) else a,
            (n.args, n.kwargs),
        )
        target = n.target
        if (
            target is _CLONE
            and kwargs.get("memory_format") == torch.contiguous_format
            and _contiguous(args[0])
        ):
            target = targets[n] = _aten.contiguous.default
            args, kwargs = (args[0],), {}
        elif target is _UNSAFE_VIEW and n.args[0] in targets:
            target = targets[n] = _aten.view.default
        try:
            val = target(*args, **kwargs)
        except Exception:  # noqa: BLE001 - a value not traced again: the graph stays as traced
            return 0
        if n in targets or _aliases(n) or not _same_layout(val, n.meta.get("val")):
            vals[n] = val
    copies = 0
    for n, val in vals.items():
        n.meta["val"] = val
    for n, target in targets.items():
        if target is _aten.contiguous.default:
            n.args, n.kwargs = (n.args[0],), {}
            copies += 1
        n.target = target
    return recompiled(joint, copies)
