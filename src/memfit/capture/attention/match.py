"""Matching dot-product attention: a softmax over the last dim whose input comes from
``a @ b`` through scales, masks and casts, and whose output, through casts and one dropout, is
read only by ``@ v``.

A softmax that does not match raises ``Skip`` saying why, which the pass reports for a softmax
fed by a matmul. Part of ``memfit.capture.attention``: see its docstring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from memfit.capture.attention.dynamo_nodes import (
    ADD,
    DIV,
    DROPOUT,
    FILL,
    MATMUL,
    MUL,
    WHERE,
    argument,
    constant,
    is_call,
    is_cast,
    shape_of,
    value_of,
)

__all__ = ["Match", "Skip", "match_dot_product", "only_user"]


class Skip(Exception):
    """The softmax is not an attention this pass can rewrite; the message says why."""


@dataclass
class Match:
    scores: fx.Node  # the a @ b node
    q: fx.Node
    k_t: fx.Node
    v: fx.Node
    chain: list[fx.Node]  # nodes between scores and the final matmul, to erase
    ops: list[tuple[str, fx.Node | None, float]]  # score ops in the order they apply
    dropout_p: float
    dropout_node: fx.Node | None
    out: fx.Node  # the final p @ v


def only_user(node: fx.Node, what: str) -> fx.Node:
    users = list(node.users)
    if len(users) != 1:
        names = ", ".join(u.name for u in users) or "nothing"
        raise Skip(f"the {what} are read by {len(users)} ops ({names})")
    return users[0]


def _walk_scores(
    node: Any, shape: tuple[int, ...], ops: list[Any], chain: list[fx.Node]
) -> fx.Node:
    """From the softmax input back to ``a @ b``, recording the ops on the scores (reversed)."""
    if not isinstance(node, fx.Node):
        raise Skip("the softmax input is not computed from a matmul")
    if shape_of(node) != shape:
        raise Skip(f"{node.name} changes the scores' shape")
    if is_call(node, MATMUL):
        return node
    chain.append(node)
    if len(node.users) != 1:
        raise Skip(f"the scores ({node.name}) are also read elsewhere")
    if is_cast(node):
        return _walk_scores(node.args[0], shape, ops, chain)
    if is_call(node, FILL):
        value = constant(argument(node, 2, "value"))
        if value is None:
            raise Skip(f"masked_fill with a computed value ({node.name})")
        ops.append(("fill", argument(node, 1, "mask"), value))
        return _walk_scores(node.args[0], shape, ops, chain)
    if is_call(node, WHERE) and len(node.args) == 3:
        cond, a, b = node.args
        for score_side, other, negate in ((a, b, True), (b, a, False)):
            value = constant(other)
            if (
                value is not None
                and isinstance(score_side, fx.Node)
                and shape_of(score_side) == shape
            ):
                ops.append(("fill_not" if negate else "fill", cond, value))
                return _walk_scores(score_side, shape, ops, chain)
        raise Skip(f"torch.where with a computed value ({node.name})")
    binary = {"mul": MUL, "div": DIV, "add": ADD}
    for kind, calls in binary.items():
        if not is_call(node, calls):
            continue
        if "alpha" in node.kwargs or "rounding_mode" in node.kwargs or len(node.args) != 2:
            raise Skip(f"{node.name} has arguments this pass does not model")
        sides = [(0, 1), (1, 0)] if kind != "div" else [(0, 1)]
        for s, o in sides:
            score_side, other = node.args[s], node.args[o]
            if not (isinstance(score_side, fx.Node) and shape_of(score_side) == shape):
                continue
            try:
                trial_ops: list[Any] = []
                trial_chain: list[fx.Node] = []
                found = _walk_scores(score_side, shape, trial_ops, trial_chain)
            except Skip:
                continue
            ops.append(_operand_op(kind, other, node))
            ops.extend(trial_ops)
            chain.extend(trial_chain)
            return found
        raise Skip(f"{node.name} does not lead back to a matmul")
    raise Skip(f"{node.name} ({node.target}) is not an op this pass models on scores")


def _operand_op(kind: str, other: Any, node: fx.Node) -> tuple[str, fx.Node | None, float]:
    value = constant(other)
    if value is not None:
        if kind == "add":
            raise Skip(f"{node.name} adds a constant to the scores")
        return (kind, None, value)
    operand = value_of(other)
    if not isinstance(operand, torch.Tensor):
        raise Skip(f"{node.name}'s other operand is not a tensor")
    if kind != "add" and operand.requires_grad:
        raise Skip(f"{node.name} scales the scores by a tensor that requires grad")
    return (kind, other, 0.0)


def match_dot_product(softmax: fx.Node) -> Match:
    scores_in = argument(softmax, 0, "input")
    shape = shape_of(scores_in)
    if shape is None or len(shape) < 2:
        raise Skip("the softmax input has no known shape")
    dim = argument(softmax, 1, "dim")
    if dim not in (-1, len(shape) - 1):
        raise Skip(f"softmax over dim {dim}, not the last")
    dtype = softmax.kwargs.get("dtype")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise Skip(f"softmax in {dtype}")
    ops: list[Any] = []
    chain: list[fx.Node] = []
    scores = _walk_scores(scores_in, shape, ops, chain)
    ops.reverse()
    chain.reverse()
    if not (
        isinstance(scores.args[0], fx.Node)
        and isinstance(scores.args[1], fx.Node)
        and len(scores.args) == 2
        and not scores.kwargs
    ):
        raise Skip("the scores' matmul has unusual arguments")
    if len(scores.users) != 1:
        raise Skip("the raw scores are also read elsewhere")
    chain.insert(0, scores)
    chain.append(softmax)
    node, dropout_p, dropout_node = softmax, 0.0, None
    while True:
        user = only_user(node, "probabilities (e.g. output_attentions=True)")
        if is_cast(user) and user.args[0] is node:
            node = user
        elif is_call(user, DROPOUT) and user.args[0] is node and dropout_node is None:
            p = argument(user, 1, "p", 0.5)
            training = argument(user, 2, "training" if user.target is F.dropout else "train", True)
            if not isinstance(p, (int, float)) or not isinstance(training, bool):
                raise Skip("dropout with a computed probability or training flag")
            dropout_p, dropout_node, node = (float(p) if training else 0.0), user, user
        elif is_call(user, MATMUL) and user.args[0] is node and len(user.args) == 2:
            chain.append(user)
            break
        else:
            raise Skip(f"the probabilities are read by {user.name} ({user.target}), not @ v")
        chain.append(node)
    out = chain[-1]
    q, k_t, v = scores.args[0], scores.args[1], out.args[1]
    assert isinstance(q, fx.Node) and isinstance(k_t, fx.Node)
    if not isinstance(v, fx.Node):
        raise Skip("the value is not a tensor")
    q_shape, k_shape, v_shape = shape_of(q), shape_of(k_t), shape_of(v)
    if q_shape is None or k_shape is None or v_shape is None or len(v_shape) < 2:
        raise Skip("q, k or v has no known shape")
    if not (q_shape[:-2] == k_shape[:-2] == v_shape[:-2] == shape[:-2]):
        raise Skip(f"batch dims of q {q_shape}, k^T {k_shape}, v {v_shape} differ (broadcast)")
    return Match(scores, q, k_t, v, chain, ops, dropout_p, dropout_node, out)
