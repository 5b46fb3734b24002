"""Attention layers written the ways real models write them, for tests and benchmarks.

Each variant computes ``softmax(q k^T * scale + mask) v`` in its own style: fused or split q/k/v
projections, the scale on q or on the scores (multiplied or divided), causal masks sliced from
a registered buffer and applied with ``masked_fill`` or ``torch.where``, padding masks added or
filled, dropout on the probabilities, 3-D ``bmm`` attention with a value head dim unlike the
query's. The capture pass must find every one of them; ``expected_kernel`` is the kernel it should
choose on CPU, and why.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["AttentionVariant", "VARIANTS", "SelfAttention", "AdditiveDecoder"]


class SelfAttention(nn.Module):
    """One self-attention layer; ``style`` picks how the attention is written out."""

    def __init__(
        self,
        style: str,
        d_model: int = 32,
        heads: int = 4,
        dropout: float = 0.0,
        max_len: int = 256,
        value_dim: int | None = None,
        return_probs: bool = False,
    ) -> None:
        super().__init__()
        self.style, self.heads, self.d_head = style, heads, d_model // heads
        self.v_head = (value_dim or d_model) // heads
        self.qk = nn.Linear(d_model, 2 * d_model)
        self.value = nn.Linear(d_model, self.v_head * heads)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(self.v_head * heads, d_model)
        self.drop = nn.Dropout(dropout)
        self.return_probs = return_probs
        causal = torch.tril(torch.ones(max_len, max_len, dtype=torch.bool))
        self.causal: torch.Tensor
        self.register_buffer("causal", causal.view(1, 1, max_len, max_len), persistent=False)

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        q, k = self.qk(x).split(self.heads * self.d_head, dim=2)
        v = self.value(x)
        q = q.view(b, t, self.heads, self.d_head).transpose(1, 2)
        k = k.view(b, t, self.heads, self.d_head).transpose(1, 2)
        v = v.view(b, t, self.heads, self.v_head).transpose(1, 2)
        return q, k, v

    def forward(self, x: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        if self.style == "fused_qkv":  # GPT-NeoX / ViT style: one projection, permute
            qkv = self.qkv(x).reshape(b, t, 3, self.heads, self.d_head).permute(2, 0, 3, 1, 4)
            q, k, v = qkv.unbind(0)
            probs = F.softmax((q @ k.transpose(-2, -1)) / math.sqrt(self.d_head), dim=-1)
        elif self.style == "scale_on_q_padding":  # T5-like: scale q, additive padding mask
            q, k, v = self._split(x)
            q = q * self.d_head**-0.5
            scores = torch.matmul(q, k.transpose(2, 3))
            assert pad is not None
            scores = scores + (1.0 - pad[:, None, None, :].float()) * torch.finfo(x.dtype).min
            probs = self.drop(scores.softmax(dim=-1))
        elif self.style == "causal_masked_fill":  # nanoGPT: buffer slice, masked_fill(-inf)
            q, k, v = self._split(x)
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            scores = scores.masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf"))
            probs = self.drop(F.softmax(scores, dim=-1))
        elif self.style == "causal_where_fp32":  # older HF GPT-2: where(..., finfo.min), fp32
            q, k, v = self._split(x)
            scores = torch.matmul(q, k.transpose(-1, -2))
            scores = scores / torch.full([], v.size(-1) ** 0.5, dtype=scores.dtype)
            fill = torch.finfo(scores.dtype).min
            scores = torch.where(self.causal[:, :, :t, :t], scores, fill)
            probs = self.drop(F.softmax(scores.float(), dim=-1).type_as(v))
        elif self.style == "bmm_3d":  # fairseq / MultiheadAttention style: [B*H, T, D] bmm
            q, k, v = self._split(x)
            q = q.reshape(b * self.heads, t, self.d_head) * self.d_head**-0.5
            k = k.reshape(b * self.heads, t, self.d_head)
            v = v.reshape(b * self.heads, t, self.v_head)
            probs = self.drop(F.softmax(torch.bmm(q, k.transpose(1, 2)), dim=-1))
            y = torch.bmm(probs, v).view(b, self.heads, t, self.v_head)
            return self.out(y.transpose(1, 2).reshape(b, t, -1))
        else:
            raise ValueError(f"unknown attention style {self.style!r}")
        y = probs @ v
        y = self.out(y.transpose(1, 2).reshape(b, t, -1))
        return (y, probs) if self.return_probs else y  # type: ignore[return-value]


@dataclass(frozen=True)
class AttentionVariant:
    name: str
    make: Callable[[], nn.Module]
    needs_padding: bool
    expected_kernel: str
    why: str


VARIANTS = (
    AttentionVariant(
        "fused_qkv",
        lambda: SelfAttention("fused_qkv"),
        False,
        "sdpa",
        "scale only, no dropout: SDPA's flash kernel takes it",
    ),
    AttentionVariant(
        "scale_on_q_padding_dropout",
        lambda: SelfAttention("scale_on_q_padding", dropout=0.1),
        True,
        "memfit",
        "dropout: CPU flash has none, memfit's kernel draws eager's masks",
    ),
    AttentionVariant(
        "causal_masked_fill",
        lambda: SelfAttention("causal_masked_fill"),
        False,
        "sdpa",
        "masked_fill(-inf) becomes a boolean SDPA mask",
    ),
    AttentionVariant(
        "causal_masked_fill_dropout",
        lambda: SelfAttention("causal_masked_fill", dropout=0.1),
        False,
        "memfit",
        "dropout",
    ),
    AttentionVariant(
        "causal_where_fp32",
        lambda: SelfAttention("causal_where_fp32"),
        False,
        "sdpa",
        "where(.., finfo.min) becomes an additive SDPA mask",
    ),
    AttentionVariant(
        "bmm_3d_value_dim",
        lambda: SelfAttention("bmm_3d", value_dim=64, dropout=0.1),
        False,
        "memfit",
        "3-D inputs and a value head dim unlike the query's",
    ),
)


class AdditiveDecoder(nn.Module):
    """A seq2seq decoder's attention written out as Bahdanau did, over ``steps`` decoder steps.

    The keys are projected once per sequence ("processed memory"); each step projects its query,
    adds, takes ``tanh``, scores with a bias-free ``Linear(H, 1)``, masks padding with -inf,
    softmaxes and reads the values. ``all_steps=True`` writes the same attention for every query
    at once ([B, Tq, Tk, H]), as a Transformer-era reimplementation would. Naive autograd keeps a
    [B, Tk, H] ``tanh`` output per step.
    """

    def __init__(self, dim: int = 16, hidden: int = 32, all_steps: bool = False) -> None:
        super().__init__()
        self.w_query = nn.Linear(dim, hidden)
        self.w_keys = nn.Linear(dim, hidden, bias=False)
        self.v = nn.Linear(hidden, 1, bias=False)
        self.cell = nn.GRUCell(dim, dim)
        self.all_steps = all_steps

    def forward(self, queries: torch.Tensor, keys: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        memory = self.w_keys(keys)  # [B, Tk, H], once
        if self.all_steps:
            energy = torch.tanh(self.w_query(queries)[:, :, None, :] + memory[:, None, :, :])
            scores = energy @ self.v.weight[0]
            scores = scores.masked_fill(~pad[:, None, :], float("-inf"))
            return scores.softmax(-1) @ keys
        h = queries[:, 0]
        outs = []
        for t in range(queries.shape[1]):
            energy = torch.tanh(self.w_query(h).unsqueeze(1) + memory)
            scores = self.v(energy).squeeze(-1).masked_fill(~pad, float("-inf"))
            alpha = F.softmax(scores, dim=-1)
            context = torch.bmm(alpha.unsqueeze(1), keys).squeeze(1)
            h = self.cell(context + queries[:, t], h)
            outs.append(h)
        return torch.stack(outs, 1)
