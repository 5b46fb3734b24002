"""Backward graphs for steps where some outputs get no gradient, as eager autograd runs them.

A model often returns more than the loss reads: Hugging Face causal LMs return their logits and
the key/value cache besides the loss. Eager autograd never makes a gradient for such an output.
An ``autograd.Function``, AOTAutograd's included, gets zeros in their place by default (autograd
"materializes" them), so the compiled backward would start with a zero tensor per unused output,
alive until the op that adds it to a real gradient: on the tiny Llama, the cache's zeros were still
alive at the backward's peak (+2% over eager), and the logits' zeros (batch x length x vocabulary)
were added to the loss's gradient.

memfit turns materialization off (``set_materialize_grads(False)`` in the forward, see
``memfit._compat.compiled_function_ctx``), so those tangents arrive as ``None``, and runs a copy
of the backward graph specialized to the tangents that are missing: their zeros are propagated
symbolically (``x + 0`` is ``x``, a view or a product of a zero is zero), and a zero tensor is made
only right before an op that needs one as an input; what only the removed ops read (a value the
backward recomputed for them) is removed too. A gradient that is zero only because of missing
tangents is returned as ``None``, as eager leaves it. Each set of missing tangents is specialized
once per graph.

The planner simulates the same specialization of the joint graph (``analysis.backward_start``):
what a step's backward holds depends on which outputs get a gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from memfit._compat import is_tangent

__all__ = ["without_tangents", "tangent_positions"]

aten = torch.ops.aten

#: Ops whose result is zero when their first argument is (views, casts, linear maps of it, and the
#: backward formulas linear in the incoming gradient).
_ZERO_IF_FIRST = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.permute.default,
    aten.transpose.int,
    aten.t.default,
    aten.expand.default,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.unsqueeze.default,
    aten.detach.default,
    aten.alias.default,
    aten.clone.default,
    aten.slice.Tensor,
    aten.select.int,
    aten._to_copy.default,
    aten.neg.default,
    aten.mul.Scalar,
    aten.div.Scalar,
    aten.div.Tensor,
    aten.sum.default,
    aten.sum.dim_IntList,
    aten.mean.dim,
    aten.threshold_backward.default,
    aten.gelu_backward.default,
    aten.silu_backward.default,
    aten.sigmoid_backward.default,
    aten.tanh_backward.default,
    aten._softmax_backward_data.default,
    aten._log_softmax_backward_data.default,
    aten.nll_loss_backward.default,
    aten.embedding_dense_backward.default,
}
#: Ops whose result is zero when any tensor argument is.
_ZERO_IF_ANY = {aten.mul.Tensor, aten.mm.default, aten.bmm.default}


def _val(node: Any) -> torch.Tensor | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _same_shape(a: Any, b: Any) -> bool:
    va, vb = _val(a), _val(b)
    return va is not None and vb is not None and va.shape == vb.shape and va.dtype == vb.dtype


def _zero_result(n: fx.Node, zero: set[fx.Node]) -> fx.Node | bool:
    """What ``n`` is when the nodes in ``zero`` are zero: True (zero too), the node it equals, or
    False (it must run, with real zeros for its zero inputs)."""
    if n.op != "call_function" or _val(n) is None:
        return False
    args = n.args
    if n.target in _ZERO_IF_FIRST and args and args[0] in zero:
        return True
    if n.target in _ZERO_IF_ANY and any(a in zero for a in args):
        return True
    if n.target in (aten.add.Tensor, aten.sub.Tensor) and len(args) == 2:
        a, b = args
        alpha = n.kwargs.get("alpha", 1)
        if a in zero and b in zero:
            return True
        if b in zero and isinstance(a, fx.Node) and _same_shape(a, n):
            return a  # a + alpha * 0
        plain_add = n.target is aten.add.Tensor and alpha == 1
        if a in zero and plain_add and isinstance(b, fx.Node) and _same_shape(b, n):
            return b  # 0 + b
    return False


def _impure(n: fx.Node) -> bool:
    """Whether ``n`` must run even when nothing reads its result (it writes, or draws random
    numbers): such a node is never removed as dead."""
    try:
        return n.op != "call_function" or n.is_impure()
    except Exception:  # is_impure() cannot inspect every target: keep it, to be safe
        return True


def _zeros(graph: fx.Graph, like: fx.Node) -> fx.Node:
    """A zero tensor shaped like ``like``, as ``aten.full``: the graph may go to Inductor, which
    compiles graphs decomposed by its own table and refuses ``aten.zeros`` (which that table
    decomposes) with "both a fallback and a decomp"; measured on the zoo's GPT-2 under
    ``executor="inductor"``, whose cache tangents reach an op that needs real zeros."""
    value = _val(like)
    assert value is not None
    node = graph.call_function(
        aten.full.default,
        (list(value.shape), 0),
        {"dtype": value.dtype, "layout": torch.strided, "device": value.device},
    )
    node.meta["val"] = value
    return node


def without_tangents(gm: fx.GraphModule, missing: set[str]) -> fx.GraphModule:
    """A copy of backward graph ``gm`` for calls where the tangents named in ``missing`` are None.

    The copy keeps ``gm``'s placeholders (the missing ones receive None and are not read).
    """
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        env[n] = graph.node_copy(n, lambda x: env[x])
    placeholders = [env[n] for n in gm.graph.nodes if n.op == "placeholder"]
    zero: set[fx.Node] = {p for p in placeholders if p.name in missing}
    replaced: set[fx.Node] = set()
    for n in list(graph.nodes):
        if n.op == "placeholder" or not any(a in zero for a in n.all_input_nodes):
            continue
        if n.op == "output":
            (outs,) = n.args
            n.args = (type(outs)(None if o in zero else o for o in outs),)
            continue
        result = _zero_result(n, zero)
        if result is True:
            zero.add(n)
        elif isinstance(result, fx.Node):
            n.replace_all_uses_with(result)
            replaced.add(n)
        else:
            for z in [a for a in n.all_input_nodes if a in zero]:
                with graph.inserting_before(n):  # born right before the one op that reads it
                    n.replace_input_with(z, _zeros(graph, z))
    # Only what this pass made dead, no general DCE: the zero and replaced nodes, then whatever
    # only they read (a value recomputed for a gradient that is now zero), so that nothing runs
    # for an output without a gradient, and the simulator, walking this graph, counts what runs.
    dead = [n for n in reversed(list(graph.nodes)) if n in replaced or n in zero]
    erased: set[fx.Node] = set()
    while dead:
        n = dead.pop(0)
        if n in erased or n.op in ("placeholder", "output") or n.users:
            continue
        if n not in replaced and n not in zero and _impure(n):
            continue
        inputs = n.all_input_nodes
        graph.erase_node(n)
        erased.add(n)
        dead.extend(inputs)
    graph.lint()
    return fx.GraphModule(gm, graph)


def tangent_positions(gm: fx.GraphModule) -> list[tuple[int, str]]:
    """``(argument index, placeholder name)`` of every tangent of backward graph ``gm``."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return [(i, p.name) for i, p in enumerate(placeholders) if is_tangent(p)]
