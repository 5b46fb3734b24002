"""The kernel for a matched dot-product attention, and the rewrite to it.

SDPA restricted to its fused kernels when the scores pass only a scale and at most one mask
SDPA can take, no dropout runs, and ``memfit.nn.attention.why_not_fused_sdpa`` finds no reason
against; memfit's chunked kernel otherwise, replaying the chain op by op. A call the model
already makes to ``F.scaled_dot_product_attention`` that would take SDPA's math path is sent to
``memfit.nn.attention.attention``. Part of ``memfit.capture.attention``: see its docstring.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx

from memfit.capture.attention.dynamo_nodes import (
    argument,
    erase_unused,
    location,
    shape_of,
    shown,
    size_args,
    value_of,
)
from memfit.capture.attention.gqa import repeated_heads
from memfit.capture.attention.match import Match
from memfit.capture.attention.site import MEMFIT, SDPA, AttentionSite
from memfit.nn.attention import attention, fused_sdpa, why_not_fused_sdpa
from memfit.nn.chunked_attention import chunked_attention
from memfit.nn.dropout_mask import attention_dropout_mask

__all__ = ["rewrite_dot_product", "rewrite_sdpa_call"]

#: A fill value at or below this acts as "minus infinity" for softmax while a row keeps at least
#: one real score: adding it to a score gives the same value as replacing the score (fp32 and
#: bf16 round s + v to v for any |s| < 1e22), so such a fill can become an additive SDPA mask.
_REPLACING_FILL = -1e30


def _sdpa_form(m: Match) -> tuple[float, tuple[str, fx.Node, float] | None] | None:
    """``(scale, mask)`` when the chain is a scale then at most one SDPA-style mask, else None."""
    scale, mask = 1.0, None
    for kind, operand, value in m.ops:
        if kind in ("mul", "div") and operand is None and mask is None:
            scale = scale * value if kind == "mul" else scale / value
        elif kind == "add" and mask is None and operand is not None:
            example = value_of(operand)
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
    example = value_of(operand)  # a fake tensor: its sizes are q's symbols where they vary
    if not isinstance(example, torch.Tensor):
        return torch.empty((), dtype=torch.bool, device="meta")
    if kind == "add":
        return torch.empty_like(example)
    return torch.empty_like(example, dtype=torch.bool if value == -math.inf else dtype)


def rewrite_dot_product(gm: fx.GraphModule, m: Match) -> tuple[str, str]:
    """Replace the matched attention by its kernel; returns ``(kernel, reason)``."""
    graph = gm.graph
    q_val, v_val, out_val = value_of(m.q), value_of(m.v), value_of(m.out)
    k_val = value_of(m.k_t).transpose(-2, -1)
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
                scores = shape_of(m.scores) or ()
                # [*B, Lq] from q, Lk from k^T: the scores themselves are erased below.
                dims = [(m.q, i) for i in range(len(scores) - 1)] + [(m.k_t, len(scores) - 1)]
                shape = size_args(graph, scores, dims)
                assert m.dropout_node is not None
                probs = value_of(m.dropout_node.args[0])
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
    erase_unused(graph, m.chain)
    return kernel, reason


def _ungroup(
    gm: fx.GraphModule, node: fx.Node, args: dict[str, Any], q: torch.Tensor, mask: Any
) -> bool:
    """Pass a fused SDPA call's keys and values unrepeated with ``enable_gqa=True`` where the
    model repeated their heads for it (``gqa.repeated_heads``) and the fused kernel still runs;
    whether it did."""
    if args["enable_gqa"]:
        return False
    k_rep, v_rep = repeated_heads(args["key"]), repeated_heads(args["value"])
    if k_rep is None or v_rep is None or k_rep[1] != v_rep[1] or k_rep[1] == 1:
        return False
    k, v = value_of(k_rep[0]), value_of(v_rep[0])
    if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        return False
    if why_not_fused_sdpa(q, k, v, mask, args["dropout_p"], args["is_causal"], True):
        return False
    chains = [[r, r.args[0], r.args[0].args[0]] for r in (args["key"], args["value"])]
    node.args, node.kwargs = (
        (),
        {
            **args,
            "key": k_rep[0],
            "value": v_rep[0],
            "enable_gqa": True,
        },
    )
    for chain in chains:
        erase_unused(gm.graph, chain)
    return True


def rewrite_sdpa_call(gm: fx.GraphModule, node: fx.Node) -> AttentionSite:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    defaults = (None, None, None, None, 0.0, False, None, False)
    args = {
        n: argument(node, i, n, d) for i, (n, d) in enumerate(zip(names, defaults, strict=True))
    }
    q, k, v = (value_of(args[n]) for n in names[:3])
    mask = value_of(args["attn_mask"])
    shape = (*q.shape[:-1], k.shape[-2]) if isinstance(q, torch.Tensor) else ()
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)) or not all(
        isinstance(args[n], (int, float, bool, type(None))) for n in names[4:]
    ):
        return AttentionSite(location(node), None, "SDPA with computed arguments", shown(shape))
    why = why_not_fused_sdpa(
        q, k, v, mask, args["dropout_p"], args["is_causal"], args["enable_gqa"]
    )
    p = float(args["dropout_p"])
    if why is None and _ungroup(gm, node, args, q, mask):
        reason = "already SDPA's fused kernel; repeated key/value heads passed as enable_gqa"
        return AttentionSite(location(node), SDPA, reason, shown(shape), p)
    if why is None:
        return AttentionSite(location(node), SDPA, "already SDPA's fused kernel", shown(shape), p)
    node.target = attention
    # SDPA names its tensors query/key/value; memfit's kernel, like its other arguments, q/k/v.
    renamed = {"query": "q", "key": "k", "value": "v"}
    node.args, node.kwargs = (), {renamed.get(n, n): args[n] for n in names}
    reason = f"SDPA would take its math path ({why})"
    return AttentionSite(location(node), MEMFIT, reason, shown(shape), p)
