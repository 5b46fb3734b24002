"""Merge the backward's repeated computations, and nothing else (Inductor executor).

``torch.compile`` merges every common subexpression of a joint graph before partitioning it
(``fx_graph_cse`` in ``min_cut_rematerialization_partition``, checked 2.13.0), and Inductor then
fuses the merged graph: kernels that read one value are fused differently from kernels that each
compute it. On the frontier's ResNet, memfit's ``budget=0.6`` keeps what ``torch.compile`` keeps
at ``activation_memory_budget=0.8``, yet without the merges five of its 19 backward kernels
differed from ``torch.compile``'s; merged, they are the same code. What merges there lies in the
backward: the decomposed BatchNorm backward computes each ``x - mean`` twice (25 pairs), and each
ReLU gradient has its own zero.

Not merged: a forward value with the same computation in backward. On the frontier's transformer
15 of 16 merges were of that kind (each LayerNorm's ``x - mean``), and planned on that graph,
``"memory"`` measured 18.6 MiB instead of 16.1, and budgets 0.25 and 0.2 peaked above 0.3's 17.1
(docs/measurements.md). A merged value is then one the forward computes and the
planner must keep or recompute, where unmerged the backward computed its own copy where needed.
``fx_graph_cse`` has no way to be told which nodes to merge, hence this pass.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from memfit._compat import OpOverload, is_tangent, op_schema
from memfit.capture.edit import bypass, recompiled

__all__ = ["merge_backward_duplicates"]


def _frozen(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    return value


def _made_from_nothing(node: fx.Node) -> bool:
    """A tensor of more than one element that reads no other value (zeros the shape of a
    gradient): made again wherever it is needed, it is never kept; merged, one copy would serve
    every reader, alive from the first to the last."""
    value = node.meta.get("val")
    return (
        not node.all_input_nodes
        and isinstance(value, torch.Tensor)
        and (not isinstance(value.numel(), int) or value.numel() > 1)
    )


def _mergeable(node: fx.Node) -> bool:
    """Pure: the same inputs give the same value, and running it once changes nothing else."""
    if node.op != "call_function" or _made_from_nothing(node):
        return False
    if node.target is operator.getitem:
        return True
    target = node.target
    if not isinstance(target, OpOverload):
        return False
    if op_schema(target).is_mutable or torch.Tag.nondeterministic_seeded in target.tags:
        return False
    return target is not torch.ops.aten.empty.memory_format


def merge_backward_duplicates(joint: fx.GraphModule) -> int:
    """Merge, in place, each pure computation ``joint``'s backward repeats into its first copy
    in the backward; returns how many were merged.

    The backward begins at the first node that reads a tangent, as in the partitioners
    (``reordering_to_mimic_autograd_engine``). A value the graph returns is not merged: the
    caller may hold two gradients that must not share a storage.
    """
    graph = joint.graph
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    readers = [position[u] for n in nodes if is_tangent(n) for u in n.users]
    if not readers:
        return 0
    output = nodes[-1]
    returned = set(output.all_input_nodes)
    first: dict[tuple[Any, ...], fx.Node] = {}
    merged = 0
    for node in nodes[min(readers) :]:
        if node in returned or not _mergeable(node):
            continue
        key = (node.target, _frozen(node.args), _frozen(node.kwargs))
        try:
            earlier = first.setdefault(key, node)
        except TypeError:  # an argument that cannot be hashed: leave it
            continue
        if earlier is not node:
            bypass(node, earlier)
            merged += 1
    return recompiled(joint, merged)
