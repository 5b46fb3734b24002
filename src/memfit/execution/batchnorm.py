"""Recompute BatchNorm in backward without touching its running statistics.

In a training graph, AOTAutograd turns ``BatchNorm``'s in-place update of ``running_mean`` and
``running_var`` into the functional op ``_native_batch_norm_legit_functional``, which *reads* the
old statistics and returns new ones; after the forward, the runtime copies the new values into
the buffers. Recomputing that op in backward would read the buffers again after they were
overwritten (autograd rightly refuses: "modified by an inplace operation") and would compute a
second update that must not happen.

In training mode BatchNorm's output does not depend on the running statistics at all. So when a
plan recomputes a BatchNorm, the node is split in two: the original op stays in forward only to
produce the new running statistics (exactly as plain PyTorch computes them, updated once), and a
``_native_batch_norm_legit.no_stats`` node, the same kernel without the statistics, produces the
output, mean and inverse std for both the forward and the recomputation. The price is one extra
statistics pass per recomputed BatchNorm in forward; the gain is that BatchNorm outputs, a large
share of a ResNet's activations, need not be kept.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from memfit.analysis.graph import JointGraph

__all__ = ["split_recomputed_batchnorm", "is_training_batchnorm"]

_FUNCTIONAL_BN = torch.ops.aten._native_batch_norm_legit_functional.default
_NO_STATS_BN = torch.ops.aten._native_batch_norm_legit.no_stats


def is_training_batchnorm(node: fx.Node) -> bool:
    return (
        node.op == "call_function"
        and node.target is _FUNCTIONAL_BN
        and len(node.args) >= 8
        and node.args[5] is True
    )


def split_recomputed_batchnorm(
    jg: JointGraph, kept: set[fx.Node], recomputed: set[fx.Node]
) -> set[fx.Node]:
    """Split every recomputed training BatchNorm of ``jg.module`` in place; return ``kept`` mapped.

    ``jg`` is stale afterwards: build a new ``JointGraph`` on ``jg.module``.
    """
    graph = jg.module.graph
    mapping: dict[fx.Node, fx.Node] = {}
    changed = False
    for bn in [n for n in jg.forward if is_training_batchnorm(n) and n in recomputed]:
        x, weight, bias, _rm, _rv, _training, momentum, eps = bn.args[:8]
        vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in (x, weight, bias)]
        fake_mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
        if fake_mode is None:
            continue
        with fake_mode:
            out_val = _NO_STATS_BN(vals[0], vals[1], vals[2], True, momentum, eps)
        with graph.inserting_after(bn):
            new_bn = graph.call_function(_NO_STATS_BN, (x, weight, bias, True, momentum, eps))
        new_bn.meta = {k: v for k, v in bn.meta.items() if k != "val"}
        new_bn.meta["val"] = out_val
        for user in list(bn.users):
            if user.target is operator.getitem and user.args[1] in (0, 1, 2):
                idx = user.args[1]
                with graph.inserting_after(new_bn):
                    item = graph.call_function(operator.getitem, (new_bn, idx))
                item.meta = dict(user.meta)
                item.meta["val"] = out_val[idx]
                user.replace_all_uses_with(item)
                graph.erase_node(user)
                mapping[user] = item
        changed = True
    if changed:
        graph.lint()
        jg.module.recompile()
    return {mapping.get(n, n) for n in kept}
