"""Find attention in a captured model and rewrite it to a kernel that keeps no Lq x Lk tensor.

Naive attention, ``softmax(q @ k^T * scale + mask) @ v``, keeps its [.., Lq, Lk] probabilities
(and often the scores) for backward: the only quadratic tensors in a transformer's step, and at
long sequence lengths nearly all of its memory. Many models still write it out (HuggingFace's
``attn_implementation="eager"``, ``output_attentions``, older architectures, hand-written
layers), and PyTorch's own SDPA silently takes the same quadratic path for dropout, 3-D inputs
and a value head dim unlike the query's.

The pass reads the Dynamo graph, before AOTAutograd, where the model's own torch calls are still
visible. It finds attention semantically rather than by template: a softmax over the last dim
whose input comes from ``a @ b`` through any chain of scale (multiply or divide), additive mask,
``masked_fill``/``where`` and casts, and whose output, through optional casts and dropout, is read
only by ``@ v``. That one rule covers fused or split q/k/v projections, scale on q or on the
scores, causal masks sliced from a buffer, padding masks, and HuggingFace's eager attention.
Each site is rewritten to

- SDPA restricted to its fused kernels, when the chain is ``scale`` then at most one mask that
  SDPA can take and no dropout runs (``memfit.nn.attention.why_not_fused_sdpa`` decides);
- otherwise memfit's chunked kernel, which replays the chain op by op on blocks of keys, with
  dropout masks drawn where the model drew them and exactly as ``F.dropout`` draws them.

Existing SDPA calls that would take the math path are sent to ``memfit.nn.attention`` too.
Sites whose probabilities have another reader (``output_attentions=True``) are left alone and
reported with the reason; nothing is replaced silently and nothing is skipped silently.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from memfit._compat import size_hint
from memfit.nn.additive import additive_attention
from memfit.nn.attention import attention, fused_sdpa, why_not_fused_sdpa
from memfit.nn.chunked_attention import chunked_attention
from memfit.nn.dropout_mask import attention_dropout_mask

__all__ = ["AttentionSite", "replace_attention", "ATTENTION_MODES", "SDPA", "MEMFIT", "ADDITIVE"]

#: ``attention=`` values: "auto" rewrites every site found, "off" leaves the graph alone.
ATTENTION_MODES = ("auto", "off")
#: Kernel names in ``AttentionSite.kernel``.
SDPA, MEMFIT, ADDITIVE = "sdpa", "memfit", "memfit-additive"

#: A fill value at or below this acts as "minus infinity" for softmax while a row keeps at least
#: one real score: adding it to a score gives the same value as replacing the score (fp32 and
#: bf16 round s + v to v for any |s| < 1e22), so such a fill can become an additive SDPA mask.
_REPLACING_FILL = -1e30


@dataclass(frozen=True)
class AttentionSite:
    """One attention found in a captured graph, and what memfit did with it.

    ``kernel`` is ``"sdpa"`` (PyTorch's fused kernel), ``"memfit"`` (memfit's chunked kernel) or
    None when the site was left as the model wrote it; ``reason`` says why in either case.
    """

    where: str
    kernel: str | None
    reason: str
    scores_shape: tuple[int, ...]
    dropout_p: float = 0.0

    def __str__(self) -> str:
        shape = "x".join(str(s) for s in self.scores_shape)
        done = f"-> {self.kernel}" if self.kernel else "left alone"
        return f"{self.where}: [{shape}] scores {done} ({self.reason})"


# -- recognising torch calls in a Dynamo graph ------------------------------------------------


#: The torch functions and the Tensor method names that compute one thing.
_Calls = tuple[tuple[Callable[..., Any], ...], tuple[str, ...]]


def _is(node: Any, calls: _Calls) -> bool:
    if not isinstance(node, fx.Node):
        return False
    functions, methods = calls
    if node.op == "call_function":
        return node.target in functions
    return node.op == "call_method" and node.target in methods


_MATMUL: _Calls = (
    (torch.matmul, operator.matmul, torch.bmm, torch.Tensor.matmul),
    ("matmul", "bmm"),
)
_SOFTMAX: _Calls = (
    (F.softmax, torch.softmax, torch.special.softmax, torch.Tensor.softmax),
    ("softmax",),
)
_DROPOUT: _Calls = ((F.dropout, torch.dropout), ())
_MUL: _Calls = ((operator.mul, operator.imul, torch.mul), ("mul",))
_DIV: _Calls = (
    (operator.truediv, operator.itruediv, torch.div, torch.true_divide),
    ("div", "true_divide"),
)
_ADD: _Calls = ((operator.add, operator.iadd, torch.add), ("add",))
_FILL: _Calls = ((torch.masked_fill,), ("masked_fill",))
_WHERE: _Calls = ((torch.where,), ())
_SDPA_CALL: _Calls = ((F.scaled_dot_product_attention,), ())
_TANH: _Calls = ((torch.tanh, F.tanh, torch.Tensor.tanh), ("tanh",))
_LINEAR: _Calls = ((F.linear,), ())
_SQUEEZE: _Calls = ((torch.squeeze,), ("squeeze",))
_UNSQUEEZE: _Calls = ((torch.unsqueeze,), ("unsqueeze",))
_CASTS = {"float", "double", "half", "bfloat16", "to", "type", "type_as", "contiguous"}


def _value(node: Any) -> Any:
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


def _shape(node: Any) -> tuple[int, ...] | None:
    """The node's shape; sizes captured as symbols stay SymInts (``int()`` would specialize the
    graph to this call's size: comparing two of the same symbol needs no guard)."""
    value = _value(node)
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _shown(shape: Any) -> tuple[int, ...]:
    """A shape for ``AttentionSite``: symbolic sizes at the sizes of the call captured."""
    return tuple(size_hint(s) for s in shape)


def _size_args(
    graph: fx.Graph, shape: tuple[Any, ...], sources: list[tuple[fx.Node, int]]
) -> list[Any]:
    """``shape`` as graph arguments: an int where the size is static, else the size read from
    ``sources[i]`` (a node and dim of that size), so the rewritten graph holds at every size."""
    out: list[Any] = []
    for s, (node, dim) in zip(shape, sources, strict=True):
        out.append(s if isinstance(s, int) else graph.call_method("size", (node, dim)))
    return out


def _arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _is_cast(node: Any) -> bool:
    """A dtype cast (or ``contiguous``): the kernel computes in fp32 whatever the model cast."""
    if not (isinstance(node, fx.Node) and node.op == "call_method" and node.target in _CASTS):
        return False
    extra = list(node.args[1:]) + [v for k, v in node.kwargs.items() if k in ("dtype", "other")]
    for a in extra:
        if isinstance(a, torch.dtype):
            if not a.is_floating_point:
                return False
        elif not (isinstance(a, fx.Node) and isinstance(_value(a), torch.Tensor)):
            return False  # a device or a string: not a plain cast
    return not any(k in node.kwargs for k in ("device", "copy"))


def _constant(arg: Any) -> float | None:
    """A Python number, or a 0-dim tensor made in the graph from one (``torch.full([], v)``)."""
    if isinstance(arg, bool):
        return None
    if isinstance(arg, (int, float)):
        return float(arg)
    if isinstance(arg, fx.Node) and arg.op == "call_function" and arg.target is torch.full:
        size, fill = _arg(arg, 0, "size"), _arg(arg, 1, "fill_value")
        if tuple(size) == () and isinstance(fill, (int, float)) and not isinstance(fill, bool):
            return float(fill)
    return None


def _where(node: fx.Node) -> str:
    """The model's submodule (as in ``named_modules()``) and source line of a node."""
    stack = node.meta.get("nn_module_stack") or {}
    module = "model"
    if stack:
        path, kind = list(stack.values())[-1]
        name = re.sub(r"^L\['[^']*'\]\.?|^L__[a-z]+__\.?", "", str(path))
        name = re.sub(r"_modules\['([^']*)'\]", r"\1", name).replace("['", ".").replace("']", "")
        module = name or getattr(kind, "__name__", str(kind))
    found = re.findall(r'File "([^"]+)", line (\d+)', node.meta.get("stack_trace") or "")
    return f"{module} ({found[-1][0].rsplit('/', 1)[-1]}:{found[-1][1]})" if found else module


# -- matching ------------------------------------------------------------------------------


class _Skip(Exception):
    """The softmax is not an attention this pass can rewrite; the message says why."""


@dataclass
class _Match:
    scores: fx.Node  # the a @ b node
    q: fx.Node
    k_t: fx.Node
    v: fx.Node
    chain: list[fx.Node]  # nodes between scores and the final matmul, to erase
    ops: list[tuple[str, fx.Node | None, float]]  # score ops in the order they apply
    dropout_p: float
    dropout_node: fx.Node | None
    out: fx.Node  # the final p @ v


def _only_user(node: fx.Node, what: str) -> fx.Node:
    users = list(node.users)
    if len(users) != 1:
        names = ", ".join(u.name for u in users) or "nothing"
        raise _Skip(f"the {what} are read by {len(users)} ops ({names})")
    return users[0]


def _walk_scores(
    node: Any, shape: tuple[int, ...], ops: list[Any], chain: list[fx.Node]
) -> fx.Node:
    """From the softmax input back to ``a @ b``, recording the ops on the scores (reversed)."""
    if not isinstance(node, fx.Node):
        raise _Skip("the softmax input is not computed from a matmul")
    if _shape(node) != shape:
        raise _Skip(f"{node.name} changes the scores' shape")
    if _is(node, _MATMUL):
        return node
    chain.append(node)
    if len(node.users) != 1:
        raise _Skip(f"the scores ({node.name}) are also read elsewhere")
    if _is_cast(node):
        return _walk_scores(node.args[0], shape, ops, chain)
    if _is(node, _FILL):
        value = _constant(_arg(node, 2, "value"))
        if value is None:
            raise _Skip(f"masked_fill with a computed value ({node.name})")
        ops.append(("fill", _arg(node, 1, "mask"), value))
        return _walk_scores(node.args[0], shape, ops, chain)
    if _is(node, _WHERE) and len(node.args) == 3:
        cond, a, b = node.args
        for score_side, other, negate in ((a, b, True), (b, a, False)):
            value = _constant(other)
            if (
                value is not None
                and isinstance(score_side, fx.Node)
                and _shape(score_side) == shape
            ):
                ops.append(("fill_not" if negate else "fill", cond, value))
                return _walk_scores(score_side, shape, ops, chain)
        raise _Skip(f"torch.where with a computed value ({node.name})")
    binary = {"mul": _MUL, "div": _DIV, "add": _ADD}
    for kind, calls in binary.items():
        if not _is(node, calls):
            continue
        if "alpha" in node.kwargs or "rounding_mode" in node.kwargs or len(node.args) != 2:
            raise _Skip(f"{node.name} has arguments this pass does not model")
        sides = [(0, 1), (1, 0)] if kind != "div" else [(0, 1)]
        for s, o in sides:
            score_side, other = node.args[s], node.args[o]
            if not (isinstance(score_side, fx.Node) and _shape(score_side) == shape):
                continue
            try:
                trial_ops: list[Any] = []
                trial_chain: list[fx.Node] = []
                found = _walk_scores(score_side, shape, trial_ops, trial_chain)
            except _Skip:
                continue
            ops.append(_operand_op(kind, other, node))
            ops.extend(trial_ops)
            chain.extend(trial_chain)
            return found
        raise _Skip(f"{node.name} does not lead back to a matmul")
    raise _Skip(f"{node.name} ({node.target}) is not an op this pass models on scores")


def _operand_op(kind: str, other: Any, node: fx.Node) -> tuple[str, fx.Node | None, float]:
    value = _constant(other)
    if value is not None:
        if kind == "add":
            raise _Skip(f"{node.name} adds a constant to the scores")
        return (kind, None, value)
    operand = _value(other)
    if not isinstance(operand, torch.Tensor):
        raise _Skip(f"{node.name}'s other operand is not a tensor")
    if kind != "add" and operand.requires_grad:
        raise _Skip(f"{node.name} scales the scores by a tensor that requires grad")
    return (kind, other, 0.0)


def _match(softmax: fx.Node) -> _Match:
    scores_in = _arg(softmax, 0, "input")
    shape = _shape(scores_in)
    if shape is None or len(shape) < 2:
        raise _Skip("the softmax input has no known shape")
    dim = _arg(softmax, 1, "dim")
    if dim not in (-1, len(shape) - 1):
        raise _Skip(f"softmax over dim {dim}, not the last")
    dtype = softmax.kwargs.get("dtype")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise _Skip(f"softmax in {dtype}")
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
        raise _Skip("the scores' matmul has unusual arguments")
    if len(scores.users) != 1:
        raise _Skip("the raw scores are also read elsewhere")
    chain.insert(0, scores)
    chain.append(softmax)
    node, dropout_p, dropout_node = softmax, 0.0, None
    while True:
        user = _only_user(node, "probabilities (e.g. output_attentions=True)")
        if _is_cast(user) and user.args[0] is node:
            node = user
        elif _is(user, _DROPOUT) and user.args[0] is node and dropout_node is None:
            p = _arg(user, 1, "p", 0.5)
            training = _arg(user, 2, "training" if user.target is F.dropout else "train", True)
            if not isinstance(p, (int, float)) or not isinstance(training, bool):
                raise _Skip("dropout with a computed probability or training flag")
            dropout_p, dropout_node, node = (float(p) if training else 0.0), user, user
        elif _is(user, _MATMUL) and user.args[0] is node and len(user.args) == 2:
            chain.append(user)
            break
        else:
            raise _Skip(f"the probabilities are read by {user.name} ({user.target}), not @ v")
        chain.append(node)
    out = chain[-1]
    q, k_t, v = scores.args[0], scores.args[1], out.args[1]
    assert isinstance(q, fx.Node) and isinstance(k_t, fx.Node)
    if not isinstance(v, fx.Node):
        raise _Skip("the value is not a tensor")
    q_shape, k_shape, v_shape = _shape(q), _shape(k_t), _shape(v)
    if q_shape is None or k_shape is None or v_shape is None or len(v_shape) < 2:
        raise _Skip("q, k or v has no known shape")
    if not (q_shape[:-2] == k_shape[:-2] == v_shape[:-2] == shape[:-2]):
        raise _Skip(f"batch dims of q {q_shape}, k^T {k_shape}, v {v_shape} differ (broadcast)")
    return _Match(scores, q, k_t, v, chain, ops, dropout_p, dropout_node, out)


# -- additive (Bahdanau) attention -----------------------------------------------------------


@dataclass
class _Additive:
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


def _match_additive(softmax: fx.Node) -> _Additive:
    """``softmax(v . tanh(Wq q + Wk k)) @ values``, Meng et al.'s layer, as seq2seq code writes it.

    The projections are computed by the model as before; the rewrite takes them as projected
    inputs (``w_query=None, w_keys=None``), so what it removes is the [.., Tk, H] ``tanh`` the
    naive form keeps for backward.
    """
    node = _arg(softmax, 0, "input")
    chain = [softmax]
    masked: fx.Node | None = None
    while isinstance(node, fx.Node) and (_is_cast(node) or _is(node, _FILL)):
        if len(node.users) != 1:
            raise _Skip(f"the scores ({node.name}) are also read elsewhere")
        if _is(node, _FILL):
            value = _constant(_arg(node, 2, "value"))
            if masked is not None or value != -math.inf:
                # the kernel masks with -inf: a finite fill would differ on fully masked rows
                raise _Skip("additive scores filled other than once with -inf")
            masked = _arg(node, 1, "mask")
        chain.append(node)
        node = node.args[0]
    if _is(node, _SQUEEZE) and len(node.users) == 1:
        chain.append(node)
        node = node.args[0]
    if _is(node, _LINEAR) and len(node.users) == 1:
        weight, bias = _arg(node, 1, "weight"), _arg(node, 2, "bias")
        if bias is not None or _shape(weight) is None or len(_shape(weight) or ()) != 2:
            raise _Skip("additive scores from a Linear with a bias")
        if (_shape(weight) or (0,))[0] != 1:
            raise _Skip("additive scores from a Linear with more than one output")
        v, v_is_weight = weight, True
    elif _is(node, _MATMUL) and len(node.users) == 1 and len(_shape(node.args[1]) or ()) == 1:
        v, v_is_weight = node.args[1], False
    else:
        raise _Skip("no v . tanh(..) producing the scores")
    chain.append(node)
    tanh = node.args[0]
    if not (_is(tanh, _TANH) and len(tanh.users) == 1):
        raise _Skip("no tanh under the additive scores")
    added = tanh.args[0]
    if not (_is(added, _ADD) and len(added.users) == 1 and len(added.args) == 2):
        raise _Skip("the tanh's input is not a sum of two projections")
    chain += [tanh, added]
    shape = _shape(added) or ()
    a, b = added.args
    sa, sb = _shape(a), _shape(b)
    if len(shape) not in (3, 4) or sa is None or sb is None or len(sa) != len(shape):
        raise _Skip("the projections' shapes are not [B, (Tq,) Tk, H]")
    step = len(shape) == 3
    key_axis = len(shape) - 2
    query_side, key_side = (a, b) if sa[key_axis] == 1 else (b, a)
    sq, sk = _shape(query_side) or (), _shape(key_side) or ()
    if sq[0] != shape[0] or sk[0] != shape[0] or sq[key_axis] != 1:
        raise _Skip("the projections broadcast over the batch")
    if not step and sk[1] != 1:
        raise _Skip("the key projection is not [B, 1, Tk, H]")
    user = _only_user(softmax, "probabilities")
    unsqueezed = False
    if step:
        is_unsqueeze = _is(user, _UNSQUEEZE) and _arg(user, 1, "dim") in (1, -2)
        is_index = (
            user.op == "call_function"
            and user.target is operator.getitem
            and user.args[1] in ((slice(None), None), (slice(None), None, slice(None)))
        )
        if not (is_unsqueeze or is_index) or len(user.users) != 1:
            raise _Skip("the step's probabilities are not unsqueezed before @ values")
        chain.append(user)
        user, unsqueezed = next(iter(user.users)), True
    if not (_is(user, _MATMUL) and user.args[0] is chain[-1 if step else 0]):
        raise _Skip("the probabilities are not multiplied into values")
    values = user.args[1]
    if not isinstance(values, fx.Node) or len(_shape(values) or ()) != 3:
        raise _Skip("values are not [B, Tk, Dv]")
    chain.append(user)
    assert isinstance(query_side, fx.Node) and isinstance(key_side, fx.Node)
    assert isinstance(v, fx.Node)
    return _Additive(
        query_side, key_side, v, v_is_weight, masked, values, step, user, unsqueezed, chain
    )


def _rewrite_additive(gm: fx.GraphModule, m: _Additive) -> None:
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
    _erase_unused(graph, m.chain)


# -- choosing and rewriting ----------------------------------------------------------------


def _erase_unused(graph: fx.Graph, chain: list[fx.Node]) -> None:
    """Erase the replaced nodes, last first, so each one's readers are gone when it is reached."""
    position = {node: i for i, node in enumerate(graph.nodes)}
    for node in sorted(chain, key=position.__getitem__, reverse=True):
        if not node.users:
            graph.erase_node(node)


def _sdpa_form(m: _Match) -> tuple[float, tuple[str, fx.Node, float] | None] | None:
    """``(scale, mask)`` when the chain is a scale then at most one SDPA-style mask, else None."""
    scale, mask = 1.0, None
    for kind, operand, value in m.ops:
        if kind in ("mul", "div") and operand is None and mask is None:
            scale = scale * value if kind == "mul" else scale / value
        elif kind == "add" and mask is None and operand is not None:
            example = _value(operand)
            if example.requires_grad or not example.is_floating_point():
                return None
            mask = ("add", operand, 0.0)
        elif kind in ("fill", "fill_not") and mask is None and operand is not None:
            if not (value == -math.inf or value <= _REPLACING_FILL):
                return None
            mask = (kind, operand, value)
        else:
            return None
    return scale, mask


def _example_mask(mask: tuple[str, fx.Node, float] | None, dtype: torch.dtype) -> Any:
    if mask is None:
        return None
    kind, operand, value = mask
    example = _value(operand)  # a fake tensor: its sizes are q's symbols where they vary
    if not isinstance(example, torch.Tensor):
        return torch.empty((), dtype=torch.bool, device="meta")
    if kind == "add":
        return torch.empty_like(example)
    return torch.empty_like(example, dtype=torch.bool if value == -math.inf else dtype)


def _rewrite(gm: fx.GraphModule, m: _Match) -> tuple[str, str]:
    """Replace the matched attention by its kernel; returns ``(kernel, reason)``."""
    graph = gm.graph
    q_val, v_val, out_val = _value(m.q), _value(m.v), _value(m.out)
    k_val = _value(m.k_t).transpose(-2, -1)
    sdpa = _sdpa_form(m) if m.dropout_p == 0 else None
    why: str | None = "dropout" if m.dropout_p else "the scores pass more than a scale and a mask"
    if sdpa is not None:
        why = why_not_fused_sdpa(q_val, k_val, v_val, _example_mask(sdpa[1], q_val.dtype))
    with graph.inserting_before(m.out):
        k = graph.call_method("transpose", (m.k_t, -2, -1))
        if sdpa is not None and why is None:
            scale, mask = sdpa
            attn_mask: fx.Node | None = None
            if mask is not None:
                kind, operand, value = mask
                if kind == "add":
                    attn_mask = operand
                elif value == -math.inf:  # bool SDPA masks say where to attend
                    attn_mask = (
                        operand
                        if kind == "fill_not"
                        else graph.call_method("logical_not", (operand,))
                    )
                else:  # a replacing fill of a huge negative value: the same as adding it
                    hit = (
                        operand if kind == "fill" else graph.call_method("logical_not", (operand,))
                    )
                    zeros = graph.call_function(torch.zeros_like, (hit,), {"dtype": q_val.dtype})
                    attn_mask = graph.call_method("masked_fill", (zeros, hit, value))
            new = graph.call_function(
                fused_sdpa, (m.q, k, m.v), {"attn_mask": attn_mask, "scale": scale}
            )
            kernel, reason = SDPA, "a scale and at most one mask, no dropout: SDPA's fused kernel"
        else:
            kinds: list[str] = []
            operands: list[fx.Node | None] = []
            values: list[float] = []
            for op_kind, op_operand, op_value in m.ops:
                if op_kind == "fill_not":
                    op_operand = graph.call_method("logical_not", (op_operand,))
                    op_kind = "fill"
                kinds.append(op_kind)
                operands.append(op_operand)
                values.append(op_value)
            keep = None
            if m.dropout_p > 0:
                scores = _shape(m.scores) or ()
                # [*B, Lq] from q, Lk from k^T: the scores themselves are erased below.
                dims = [(m.q, i) for i in range(len(scores) - 1)] + [(m.k_t, len(scores) - 1)]
                shape = _size_args(graph, scores, dims)
                assert m.dropout_node is not None
                probs = _value(m.dropout_node.args[0])
                keep = graph.call_function(
                    attention_dropout_mask,
                    (shape, m.dropout_p, q_val.device),
                    {"dtype": probs.dtype},
                )
            new = graph.call_function(
                chunked_attention,
                (m.q, k, m.v, kinds, operands, values),
                {"dropout_p": m.dropout_p, "dropout_mask": keep},
            )
            kernel, reason = MEMFIT, f"SDPA would store the probabilities: {why}"
        if out_val.dtype != v_val.dtype:
            new = graph.call_method("to", (new, out_val.dtype))
    m.out.replace_all_uses_with(new)
    _erase_unused(graph, m.chain)
    return kernel, reason


def _rewrite_sdpa_call(gm: fx.GraphModule, node: fx.Node) -> AttentionSite:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    defaults = (None, None, None, None, 0.0, False, None, False)
    args = {n: _arg(node, i, n, d) for i, (n, d) in enumerate(zip(names, defaults, strict=True))}
    q, k, v = (_value(args[n]) for n in names[:3])
    mask = _value(args["attn_mask"])
    shape = (*q.shape[:-1], k.shape[-2]) if isinstance(q, torch.Tensor) else ()
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)) or not all(
        isinstance(args[n], (int, float, bool, type(None))) for n in names[4:]
    ):
        return AttentionSite(_where(node), None, "SDPA with computed arguments", _shown(shape))
    why = why_not_fused_sdpa(
        q, k, v, mask, args["dropout_p"], args["is_causal"], args["enable_gqa"]
    )
    p = float(args["dropout_p"])
    if why is None:
        return AttentionSite(_where(node), SDPA, "already SDPA's fused kernel", _shown(shape), p)
    node.target = attention
    # SDPA names its tensors query/key/value; memfit's kernel, like its other arguments, q/k/v.
    renamed = {"query": "q", "key": "k", "value": "v"}
    node.args, node.kwargs = (), {renamed.get(n, n): args[n] for n in names}
    reason = f"SDPA would take its math path ({why})"
    return AttentionSite(_where(node), MEMFIT, reason, _shown(shape), p)


def replace_attention(gm: fx.GraphModule) -> list[AttentionSite]:
    """Rewrite, in place, every attention in a Dynamo graph; return what was found and done."""
    sites: list[AttentionSite] = []
    for node in list(gm.graph.nodes):
        if node.graph is not gm.graph or node.op == "output":
            continue
        if _is(node, _SDPA_CALL):
            sites.append(_rewrite_sdpa_call(gm, node))
        elif _is(node, _SOFTMAX):
            where, shape = _where(node), _shown(_shape(_arg(node, 0, "input")) or ())
            try:
                m = _match(node)
            except _Skip as skip:
                try:
                    additive = _match_additive(node)
                except _Skip as not_additive:
                    if _fed_by(node, _TANH):
                        sites.append(AttentionSite(where, None, str(not_additive), shape))
                    elif _fed_by(node, _MATMUL):
                        sites.append(AttentionSite(where, None, str(skip), shape))
                    continue
                _rewrite_additive(gm, additive)
                reason = "additive attention: the tanh block is recomputed in backward"
                sites.append(AttentionSite(where, ADDITIVE, reason, shape))
                continue
            kernel, reason = _rewrite(gm, m)
            sites.append(AttentionSite(where, kernel, reason, shape, m.dropout_p))
    if sites:
        gm.graph.lint()
        gm.recompile()
    return sites


def _fed_by(softmax: fx.Node, calls: _Calls, depth: int = 6) -> bool:
    """Whether ``calls`` computes the softmax's input within ``depth`` ops: a softmax fed by a
    matmul (or a tanh, for additive attention) is worth reporting when it is left alone."""
    level: list[Any] = [_arg(softmax, 0, "input")]
    for _ in range(depth):
        if any(_is(node, calls) for node in level):
            return True
        level = [a for node in level if isinstance(node, fx.Node) for a in node.all_input_nodes]
    return False
