"""Give every training BatchNorm a twin that can be recomputed without its running statistics.

In a training graph, AOTAutograd turns ``BatchNorm``'s in-place update of ``running_mean`` and
``running_var`` into the functional op ``_native_batch_norm_legit_functional``, which *reads* the
old statistics and returns new ones; after the forward, the runtime copies the new values into
the buffers. Recomputing that op in backward would read the buffers after they were overwritten
(autograd rightly refuses: "modified by an inplace operation") and compute a second update that
must not happen.

In training mode BatchNorm's output does not depend on the running statistics at all. So this
pass, which runs on the joint graph *before* analysis and planning, gives each training BatchNorm
a twin: ``_native_batch_norm_legit.no_stats``, the same kernel without the statistics (its output,
mean and inverse std are bit-for-bit those of the functional op; checked on CPU). The original op
keeps producing the new running statistics; the twin's items replace the original's output, mean
and inverse std everywhere, so a plan that recomputes a BatchNorm recomputes the twin and never
touches the statistics.

A training BatchNorm's backward reads no statistics either, yet AOTAutograd hands
``native_batch_norm_backward`` the *new* running mean and variance (the functional op's items 3
and 4): a backward reader makes them saved values, two channel-sized tensors per BatchNorm held
from the forward to that BatchNorm's backward, where eager autograd holds only the module's own
buffers (no new memory). On HF ResNet and RegNet that put memfit's ``"none"`` a few hundred bytes
above plain PyTorch's peak. ``drop_backward_statistics`` passes ``None`` for them, as eager does
for a BatchNorm without running statistics: in training mode the kernel reads the saved mean and
inverse std only, so the gradients are the same bits and the new statistics die when the runtime
has copied them into the buffers.

Why a twin and not a split only where the plan recomputes: a rewrite *after* planning would change
the graph the plan was simulated on (the old code re-simulated and patched the peak afterwards).
With the twin in place before analysis, the plan describes exactly the graphs that run. The twin
costs nothing in forward: its fake values are the original op's own (same storages), so the
memory model sees no second allocation, and the executor computes it in the forward graph from
the original op (``execution.split``): one BatchNorm kernel per forward, as in eager PyTorch,
and a ``no_stats`` kernel in backward where the plan recomputes it.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from memfit.capture.edit import bypass, recompiled

__all__ = [
    "FORWARD_TWIN",
    "add_batchnorm_twins",
    "drop_backward_statistics",
    "is_training_batchnorm",
]

_FUNCTIONAL_BN = torch.ops.aten._native_batch_norm_legit_functional.default
_NO_STATS_BN = torch.ops.aten._native_batch_norm_legit.no_stats
_BN_BACKWARD = torch.ops.aten.native_batch_norm_backward.default
#: ``native_batch_norm_backward``'s arguments: running mean and variance, and ``train``.
_INPUT, _WEIGHT, _RUNNING_MEAN, _RUNNING_VAR, _TRAIN = 1, 2, 3, 4, 7

#: ``node.meta`` key of a twin: the name of the op whose first results it repeats. In a forward
#: graph the executor takes those results from that op instead of running the twin.
FORWARD_TWIN = "memfit_forward_twin"


def is_training_batchnorm(node: fx.Node) -> bool:
    """A training-mode ``_native_batch_norm_legit_functional`` (reads and updates statistics)."""
    return (
        node.op == "call_function"
        and node.target is _FUNCTIONAL_BN
        and len(node.args) >= 8
        and node.args[5] is True
    )


def add_batchnorm_twins(joint: fx.GraphModule) -> int:
    """Give every training BatchNorm of ``joint`` a ``no_stats`` twin (see above), in place.

    Returns how many were added. Readers of the original's output, mean and inverse std read the
    twin's from then on; the running statistics (items 3 and 4) still come from the original.
    """
    graph = joint.graph
    count = 0
    for bn in [n for n in graph.nodes if is_training_batchnorm(n)]:
        x, weight, bias, _rm, _rv, _training, momentum, eps = bn.args[:8]
        results = bn.meta.get("val")
        if not isinstance(results, (tuple, list)) or len(results) < 3:
            continue  # no fake values to describe the twin with: leave it unsplit
        with graph.inserting_after(bn):
            twin = graph.call_function(_NO_STATS_BN, (x, weight, bias, True, momentum, eps))
        twin.meta = {k: v for k, v in bn.meta.items() if k != "val"}
        # The original's own fake tensors: same storages, so analysis sees one allocation.
        twin.meta["val"] = tuple(results[:3])
        twin.meta[FORWARD_TWIN] = bn.name
        for user in list(bn.users):
            if user.target is operator.getitem and user.args[1] in (0, 1, 2):
                with graph.inserting_after(twin):
                    item = graph.call_function(operator.getitem, (twin, user.args[1]))
                item.meta = dict(user.meta)
                bypass(user, item)
        count += 1
    return recompiled(joint, count)


def drop_backward_statistics(joint: fx.GraphModule) -> int:
    """Pass ``None`` as the running statistics of every training ``native_batch_norm_backward``
    of ``joint``, in place (see above): it never reads them, and a graph value it names is kept
    for it from the forward. Returns how many backward calls changed."""
    count = 0
    for node in joint.graph.nodes:
        if node.op != "call_function" or node.target is not _BN_BACKWARD:
            continue
        args = list(node.args)
        if len(args) <= _TRAIN or args[_TRAIN] is not True:
            continue  # evaluation mode: the statistics are what it normalizes with
        if args[_RUNNING_MEAN] is None and args[_RUNNING_VAR] is None:
            continue
        if not _same_kernel_without_statistics(args):
            continue
        args[_RUNNING_MEAN] = args[_RUNNING_VAR] = None
        node.args = tuple(args)
        count += 1
    return recompiled(joint, count)


def _dtype(arg: object) -> torch.dtype | None:
    val = arg.meta.get("val") if isinstance(arg, fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


def _same_kernel_without_statistics(args: list[object]) -> bool:
    """Whether the kernel takes the same path with the statistics left out. Both CPU and CUDA
    pick a mixed-precision kernel from the dtype of the parameters given (weight, statistics:
    all one dtype) against the input's; with a weight the statistics change nothing, without one
    they do unless they have the input's dtype."""
    if args[_WEIGHT] is not None:
        return True
    stats = {_dtype(args[_RUNNING_MEAN]), _dtype(args[_RUNNING_VAR])}
    return stats == {_dtype(args[_INPUT])} and None not in stats
