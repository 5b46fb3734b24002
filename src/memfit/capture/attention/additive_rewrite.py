"""Additive (Bahdanau) attention, ``softmax(v . tanh(Wq q + Wk k)) @ values``: matched in the
Dynamo graph and rewritten to ``memfit.nn.additive.additive_attention``, which recomputes the
``tanh`` block in backward instead of keeping it.

Part of ``memfit.capture.attention``: see its docstring.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch.fx as fx

from memfit.capture.attention.dynamo_nodes import (
    ADD,
    FILL,
    LINEAR,
    MATMUL,
    SQUEEZE,
    TANH,
    UNSQUEEZE,
    argument,
    constant,
    erase_unused,
    is_call,
    is_cast,
    shape_of,
)
from memfit.capture.attention.match import Skip, only_user
from memfit.nn.additive import additive_attention

__all__ = ["Additive", "match_additive", "rewrite_additive"]


@dataclass
class Additive:
    query: fx.Node  # projected query, [B, Tq, 1, H] or [B, 1, H] (one decoder step)
    keys: fx.Node  # projected keys, [B, 1, Tk, H] or [B, Tk, H]
    v: fx.Node  # [H], or a [1, H] Linear weight
    v_is_weight: bool
    masked: fx.Node | None  # bool, True where the scores were filled with -inf
    values: fx.Node
    step: bool  # one decoder step: query [B, H], probabilities [B, Tk]
    out: fx.Node  # the node whose value the op's result replaces
    unsqueezed: bool  # out is [B, 1, Dv] (probabilities unsqueezed before @ values)
    chain: list[fx.Node]


def match_additive(softmax: fx.Node) -> Additive:
    """``softmax(v . tanh(Wq q + Wk k)) @ values``, Meng et al.'s layer, as seq2seq code writes it.

    The projections are computed by the model as before; the rewrite takes them as projected
    inputs (``w_query=None, w_keys=None``), so what it removes is the [.., Tk, H] ``tanh`` the
    naive form keeps for backward.
    """
    node = argument(softmax, 0, "input")
    chain = [softmax]
    masked: fx.Node | None = None
    while isinstance(node, fx.Node) and (is_cast(node) or is_call(node, FILL)):
        if len(node.users) != 1:
            raise Skip(f"the scores ({node.name}) are also read elsewhere")
        if is_call(node, FILL):
            value = constant(argument(node, 2, "value"))
            if masked is not None or value != -math.inf:
                # the kernel masks with -inf: a finite fill would differ on fully masked rows
                raise Skip("additive scores filled other than once with -inf")
            masked = argument(node, 1, "mask")
        chain.append(node)
        node = node.args[0]
    if is_call(node, SQUEEZE) and len(node.users) == 1:
        chain.append(node)
        node = node.args[0]
    if is_call(node, LINEAR) and len(node.users) == 1:
        weight, bias = argument(node, 1, "weight"), argument(node, 2, "bias")
        if bias is not None or shape_of(weight) is None or len(shape_of(weight) or ()) != 2:
            raise Skip("additive scores from a Linear with a bias")
        if (shape_of(weight) or (0,))[0] != 1:
            raise Skip("additive scores from a Linear with more than one output")
        v, v_is_weight = weight, True
    elif is_call(node, MATMUL) and len(node.users) == 1 and len(shape_of(node.args[1]) or ()) == 1:
        v, v_is_weight = node.args[1], False
    else:
        raise Skip("no v . tanh(..) producing the scores")
    chain.append(node)
    tanh = node.args[0]
    if not (is_call(tanh, TANH) and len(tanh.users) == 1):
        raise Skip("no tanh under the additive scores")
    added = tanh.args[0]
    if not (is_call(added, ADD) and len(added.users) == 1 and len(added.args) == 2):
        raise Skip("the tanh's input is not a sum of two projections")
    chain += [tanh, added]
    shape = shape_of(added) or ()
    a, b = added.args
    sa, sb = shape_of(a), shape_of(b)
    if len(shape) not in (3, 4) or sa is None or sb is None or len(sa) != len(shape):
        raise Skip("the projections' shapes are not [B, (Tq,) Tk, H]")
    step = len(shape) == 3
    key_axis = len(shape) - 2
    query_side, key_side = (a, b) if sa[key_axis] == 1 else (b, a)
    sq, sk = shape_of(query_side) or (), shape_of(key_side) or ()
    if sq[0] != shape[0] or sk[0] != shape[0] or sq[key_axis] != 1:
        raise Skip("the projections broadcast over the batch")
    if not step and sk[1] != 1:
        raise Skip("the key projection is not [B, 1, Tk, H]")
    user = only_user(softmax, "probabilities")
    unsqueezed = False
    if step:
        is_unsqueeze = is_call(user, UNSQUEEZE) and argument(user, 1, "dim") in (1, -2)
        is_index = (
            user.op == "call_function"
            and user.target is operator.getitem
            and user.args[1] in ((slice(None), None), (slice(None), None, slice(None)))
        )
        if not (is_unsqueeze or is_index) or len(user.users) != 1:
            raise Skip("the step's probabilities are not unsqueezed before @ values")
        chain.append(user)
        user, unsqueezed = next(iter(user.users)), True
    if not (is_call(user, MATMUL) and user.args[0] is chain[-1 if step else 0]):
        raise Skip("the probabilities are not multiplied into values")
    values = user.args[1]
    if not isinstance(values, fx.Node) or len(shape_of(values) or ()) != 3:
        raise Skip("values are not [B, Tk, Dv]")
    chain.append(user)
    assert isinstance(query_side, fx.Node) and isinstance(key_side, fx.Node)
    assert isinstance(v, fx.Node)
    return Additive(
        query_side, key_side, v, v_is_weight, masked, values, step, user, unsqueezed, chain
    )


def rewrite_additive(gm: fx.GraphModule, m: Additive) -> None:
    graph = gm.graph
    with graph.inserting_before(m.out):
        if m.step:  # query [B, 1, H] -> [B, H]; keys [B, Tk, H] as they are
            query = graph.call_method("squeeze", (m.query, 1))
            keys = m.keys
        else:  # query [B, Tq, 1, H] -> [B, Tq, H]; keys [B, 1, Tk, H] -> [B, Tk, H]
            query = graph.call_method("squeeze", (m.query, 2))
            keys = graph.call_method("squeeze", (m.keys, 1))
        v = graph.call_method("reshape", (m.v, -1)) if m.v_is_weight else m.v
        mask = graph.call_method("logical_not", (m.masked,)) if m.masked is not None else None
        new = graph.call_function(additive_attention, (query, keys, m.values, None, None, v, mask))
        if m.unsqueezed:
            new = graph.call_method("unsqueeze", (new, 1))
    m.out.replace_all_uses_with(new)
    erase_unused(graph, m.chain)
