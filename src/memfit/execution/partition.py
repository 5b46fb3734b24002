"""Apply a plan to a joint graph: the forward graph that keeps the chosen values, and the backward
graph that recomputes the rest just in time.

The split itself is AOTAutograd's own ``_extract_fwd_bwd_modules``, the function behind its
default and min-cut partitioners: it knows the calling convention between the forward graph, the
autograd.Function that runs it and the backward graph, which has changed across torch releases.
memfit only chooses ``saved_values`` and then reorders the backward graph with the same
``order_backward`` the simulator replays, so what runs is what was predicted.
"""

from __future__ import annotations

import inspect
from typing import Any, Iterable

import torch.fx as fx
from torch._functorch import partitioners

from memfit.analysis.graph import JointGraph
from memfit.analysis.simulate import order_backward

__all__ = ["split_joint_graph", "reorder_backward_graph"]


def split_joint_graph(
    jg: JointGraph, kept: Iterable[fx.Node], **partition_kwargs: Any
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Forward and backward graph modules that keep exactly ``kept`` (as ordered in the graph)."""
    kept_set = set(kept)
    saved_values = [n for n in jg.nodes if n in kept_set]
    extract = partitioners._extract_fwd_bwd_modules
    params = inspect.signature(extract).parameters
    kwargs: dict[str, Any] = {"num_fwd_outputs": jg.num_fwd_outputs}
    if "static_lifetime_input_nodes" in params and "static_lifetime_input_indices" in partition_kwargs:
        indices = partition_kwargs["static_lifetime_input_indices"] or []
        placeholders = [n for n in jg.nodes if n.op == "placeholder"]
        ordered_set = getattr(partitioners, "OrderedSet", set)
        kwargs["static_lifetime_input_nodes"] = ordered_set(placeholders[i] for i in indices)
    fw, bw = extract(jg.module, saved_values, saved_sym_nodes=[], **kwargs)
    fw.graph.eliminate_dead_code()
    fw.recompile()
    bw.graph.eliminate_dead_code()
    return fw, reorder_backward_graph(bw)


def reorder_backward_graph(bw: fx.GraphModule) -> fx.GraphModule:
    """Reorder ``bw`` so each recomputed value is born right before the gradient that reads it."""
    graph = bw.graph
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output = next(n for n in nodes if n.op == "output")
    tangent_dependent: set[fx.Node] = {p for p in placeholders if "tangents" in p.name}
    for n in nodes:
        if n.op == "call_function" and any(a in tangent_dependent for a in n.all_input_nodes):
            tangent_dependent.add(n)
    body = [n for n in nodes if n.op not in ("placeholder", "output")]
    order = order_backward(
        body,
        lambda n: n in tangent_dependent and n.op == "call_function",
        set(placeholders),
        output.all_input_nodes,
    )
    new_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in placeholders + order + [output]:
        env[n] = new_graph.node_copy(n, lambda x: env[x])
    new_graph.lint()
    return fx.GraphModule(bw, new_graph)
