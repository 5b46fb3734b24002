"""What recomputing a node costs, in FLOPs, and which nodes are expensive enough to keep.

FLOPs of matrix products, convolutions and attention come from PyTorch's own formulas
(``torch.utils.flop_counter``), applied to the fake tensors tracing left on each node, so the
numbers agree with ``FlopCounterMode``. Everything else (elementwise ops, norms, reductions) is
charged one FLOP per output element: it is memory-bound, and its cost grows with what it writes.

``node_seconds`` turns FLOPs and bytes moved into an estimated time (a roofline: the slower of
compute and memory traffic). The budget planner minimises this rather than FLOPs because on every
device we measured, elementwise ops (BatchNorm, ReLU, adds) cost far more time than their FLOPs
suggest: recomputing them is not free, and a FLOP count alone would call it free.

Where sizes are symbolic (dynamic shapes), the formulas run on the SymInts and the result is read
at ``sizes`` (``analysis.sizes``): the capture's hints by default, without a guard.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from memfit._compat import tree_map
from memfit.analysis.graph import is_view_op, node_tensors
from memfit.analysis.sizes import HINTS, Sizes

__all__ = ["node_flops", "node_seconds", "is_compute_heavy", "DEVICE_SPEED"]

aten = torch.ops.aten

_HEAVY_PACKETS = {
    aten.mm,
    aten.addmm,
    aten.bmm,
    aten.baddbmm,
    aten.matmul,
    aten.linear,
    aten.convolution,
    aten._convolution,
    aten.conv2d,
    aten.conv1d,
    aten.conv3d,
    aten.scaled_dot_product_attention,
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_flash_attention_for_cpu,
}
for _name in (
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
    "_efficient_attention_forward",
    "_native_multi_head_attention",
):
    if hasattr(aten, _name):
        _HEAVY_PACKETS.add(getattr(aten, _name))


def _packet(node: fx.Node) -> Any:
    return getattr(node.target, "overloadpacket", None)


def _is_memfit_attention(node: fx.Node) -> bool:
    """memfit's own attention kernels (``memfit.nn``): custom ops in the ``memfit`` namespace.

    Their FLOP formulas are registered with ``torch.utils.flop_counter`` where they are defined,
    so ``node_flops`` prices them like SDPA; they are heavy for the same reason SDPA is.
    """
    target = node.target
    return getattr(target, "namespace", None) == "memfit" and "attention" in str(target)


def is_compute_heavy(node: fx.Node) -> bool:
    """Matrix products, convolutions and attention: the ops ``"speed"`` mode never recomputes."""
    return node.op == "call_function" and (
        _packet(node) in _HEAVY_PACKETS or _is_memfit_attention(node)
    )


def _attention_flops(node: fx.Node) -> Any:
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else None for a in node.args[:3]]
    q, k, v = vals
    if not (
        isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    ):
        return 0
    *batch, lq, e = q.shape
    ls = k.shape[-2]
    ev = v.shape[-1]
    b: Any = 1
    for d in batch:
        b *= d
    return 2 * b * lq * ls * (e + ev)


def node_flops(node: fx.Node, sizes: Sizes = HINTS) -> int:
    """Estimated FLOPs of running ``node`` once (0 for views, getitems and placeholders), with
    symbolic sizes read at ``sizes``."""
    if node.op != "call_function":
        return 0
    packet = _packet(node)
    if packet is aten._scaled_dot_product_flash_attention_for_cpu:
        return sizes(_attention_flops(node))
    from torch.utils.flop_counter import flop_registry

    formula = flop_registry.get(packet)
    if formula is not None:

        def unwrap(a: Any) -> Any:
            return a.meta.get("val") if isinstance(a, fx.Node) else a

        try:
            args = tree_map(unwrap, node.args)
            kwargs = tree_map(unwrap, dict(node.kwargs))
            return sizes(formula(*args, **kwargs, out_val=node.meta.get("val")))
        except Exception:  # a formula that does not fit this overload: fall through
            pass
    outs = node_tensors(node)
    if not outs or _is_view(node):
        return 0
    return sum(sizes(t.numel()) for t in outs)


def _is_view(node: fx.Node) -> bool:
    if getattr(node.target, "_schema", None) is None:
        return True  # getitem and other Python-level glue
    return is_view_op(node)


#: Rough sustained (FLOP/s, bytes/s) per device type for the roofline estimate. Only the ratio of
#: the two steers the planner (which of two plans recomputes less time); absolute values set the
#: unit of ``recompute_seconds``. CPU: a few cores of AVX2/AVX-512; CUDA: a current data-center GPU
#: in fp32/tf32 with HBM.
DEVICE_SPEED: dict[str, tuple[float, float]] = {
    "cpu": (1e11, 2e10),
    "cuda": (5e13, 2e12),
}


def _bytes_moved(node: fx.Node, sizes: Sizes) -> int:
    total = sum(sizes(t.numel()) * t.element_size() for t in node_tensors(node))
    for a in node.all_input_nodes:
        total += sum(sizes(t.numel()) * t.element_size() for t in node_tensors(a))
    return total


def node_seconds(node: fx.Node, sizes: Sizes = HINTS, fused: bool = False) -> float:
    """Estimated time of running ``node`` once: max(FLOPs / peak FLOP/s, bytes moved / bandwidth).

    Views, getitems and placeholders cost nothing. ``fused``: the executor fuses elementwise ops
    and reductions into the kernels around them (Inductor), so such an op, recomputed, adds its
    arithmetic to a kernel that runs anyway and moves no bytes of its own: FLOPs only. Matrix
    products, convolutions and attention stay separate kernels and keep the roofline. This is
    the reason ``torch.compile``'s min-cut partitioner recomputes elementwise chains freely;
    measured with the roofline for everything, memfit's Inductor plans were up to 1.28x
    ``torch.compile``'s time at equal peak on a U-Net.
    """
    if node.op != "call_function" or _is_view(node):
        return 0.0
    outs = node_tensors(node)
    device = outs[0].device.type if outs else "cpu"
    flops_rate, bandwidth = DEVICE_SPEED.get(device, DEVICE_SPEED["cuda"])
    compute = node_flops(node, sizes) / flops_rate
    if fused and not is_compute_heavy(node):
        return compute
    return max(compute, _bytes_moved(node, sizes) / bandwidth)
