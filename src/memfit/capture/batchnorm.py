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

__all__ = ["FORWARD_TWIN", "add_batchnorm_twins", "is_training_batchnorm"]

_FUNCTIONAL_BN = torch.ops.aten._native_batch_norm_legit_functional.default
_NO_STATS_BN = torch.ops.aten._native_batch_norm_legit.no_stats

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
