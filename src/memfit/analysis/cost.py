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

from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from memfit._compat import op_schema, tree_map
from memfit.analysis.graph import JointGraph, is_view_op, node_tensors
from memfit.analysis.sizes import HINTS, Sizes

__all__ = ["node_flops", "node_seconds", "is_compute_heavy", "keeping_seconds", "DEVICE_SPEED"]

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


_COPIES = {aten.cat, aten.stack, aten.clone, aten.constant_pad_nd, aten.max_pool2d_with_indices}
if hasattr(torch.ops.prims, "_low_memory_max_pool_with_offsets"):
    _COPIES.add(torch.ops.prims._low_memory_max_pool_with_offsets)


def _packet(node: fx.Node) -> Any:
    return getattr(node.target, "overloadpacket", None)


def _is_memfit_attention(node: fx.Node) -> bool:
    """memfit's own attention and loss-head kernels (``memfit.nn``): custom ops in the
    ``memfit`` namespace.

    Their FLOP formulas are registered with ``torch.utils.flop_counter`` where they are defined,
    so ``node_flops`` prices them like SDPA; they are heavy for the same reason SDPA is.
    """
    target = node.target
    name = str(target)
    return getattr(target, "namespace", None) == "memfit" and (
        "attention" in name or "linear_cross_entropy" in name
    )


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
    if op_schema(node.target) is None:
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
        if _packet(node) in _COPIES and any(is_compute_heavy(u) for u in node.users):
            # A copy (a concatenation, a pooling's gather) that a convolution or matrix product
            # reads is written to memory for that external kernel, recomputed or not: priced at
            # its write. Priced at its FLOPs (none), a U-Net's budgets recomputed the `cat`s
            # and max-pools its decoder's convolutions read instead of keeping them.
            return sum(sizes(t.numel()) * t.element_size() for t in node_tensors(node)) / bandwidth
        return compute
    return max(compute, _bytes_moved(node, sizes) / bandwidth)


#: ``JointGraph.derived``'s key for the storages the forward writes whatever is kept
_WRITTEN_ANYWAY = "storages_written_anyway"


def keeping_seconds(jg: JointGraph, kept: Iterable[fx.Node]) -> float:
    """Estimated time a step spends on keeping ``kept`` for backward under a fusing executor
    (``jg.fused_elementwise``), at the device's bandwidth: each storage read once by the
    backward, and written once by the forward where it would not write it otherwise. Zero for
    the eager executor, whose kernels write every value and whose recomputation is priced at
    its memory traffic (``node_seconds``) already.

    What the forward writes whatever is kept: the outputs and inputs of matrix products and
    convolutions (kernels of their own, which read and write memory), the step's outputs and
    inputs, and the values the forward still reads after a matrix product or convolution that
    depends on them (:func:`_read_across_kernels`: a residual sum, read by the next block's
    normalisation and by the next block's sum after its convolutions). The rest, elementwise ops
    and reductions, Inductor fuses into the kernels that read them, and writes only what is kept.

    Why: under Inductor a value the backward recomputes inside its fused kernels costs only its
    arithmetic (``node_seconds``), so by recomputation alone the plan keeping everything is the
    cheapest. On the budget frontier's CPU ResNet it is not: the forward of the plan keeping
    59.8 MiB took 1.13x that of ``torch.compile``'s partition keeping 33.7 MiB with the same
    kernels, the backward 0.98x, and the plan ran 1.047x that partition's step
    (``docs/measurements.md``). Priced at the forward's writes only
    (form 6), the ResNet's roomy budgets kept four convolutions' outputs to recompute two
    residual sums from them (35.3 MiB, about 1% slower than that partition); the read makes
    what a plan keeps cost something wherever it is written, and the sums written anyway make
    keeping them cheaper than keeping what they are summed from. Charged a write and a read for
    everything kept (form 1), the U-Net's budget plans recomputed its concatenations and
    max-pools and ran 5-12% slower; with ``node_seconds``'s price of copies its plans stay
    those chosen without the read, as do the transformer's.
    """
    if not jg.fused_elementwise:
        return 0.0
    written = jg.derived.get(_WRITTEN_ANYWAY)
    if written is None:
        anyway = [n for n in jg.forward if is_compute_heavy(n)]
        anyway += [a for n in anyway for a in n.all_input_nodes]
        anyway += jg.fwd_outputs
        anyway += _read_across_kernels(jg.forward_computed)
        written = jg.derived[_WRITTEN_ANYWAY] = {k for n in anyway for k in jg.storages.get(n, ())}
    keys = {k for n in kept for k in jg.storages.get(n, ()) if k not in jg.primal_keys}
    return sum(
        jg.storage_bytes[k]
        * (1 if k in written else 2)
        / DEVICE_SPEED.get(jg.storage_devices[k].type, DEVICE_SPEED["cuda"])[1]
        for k in keys
    )


def _read_across_kernels(forward: list[fx.Node]) -> list[fx.Node]:
    """The nodes of ``forward`` (in order) that one of their users reads after a matrix product
    or convolution depending on them has run: such a value outlives the fused kernel that made
    it, so the forward writes it to memory whether the backward keeps it or not.

    Why: a pre-activation ResNet's residual sum feeds its next block's BatchNorm and, after that
    block's two convolutions, its next residual sum. Charged as a write only kept values cause,
    the budget frontier's CPU ResNet recomputed two such sums from the convolutions they add
    (keeping both) instead of keeping the sums, a 35.3 MiB plan about 1% slower than
    ``torch.compile``'s 33.7 MiB partition keeping the sums.

    One pass in order with bit sets over the forward's positions: ``reach`` holds a node's
    ancestors (itself included), ``through`` the nodes with a path to it through a matrix
    product or convolution; a node is read across a kernel when it is in a user's ``through``.
    """
    position = {n: i for i, n in enumerate(forward)}
    reach: dict[fx.Node, int] = {}
    through: dict[fx.Node, int] = {}
    for n in forward:
        r = t = 0
        for a in n.all_input_nodes:
            if a in position:
                r |= reach[a]
                t |= through[a]
        if is_compute_heavy(n):
            t |= r  # every ancestor reaches what follows n through n
        reach[n] = r | 1 << position[n]
        through[n] = t
    return [
        n for n in forward if any(u in through and through[u] >> position[n] & 1 for u in n.users)
    ]
