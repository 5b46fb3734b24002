"""Additive (Bahdanau) attention that never stores its ``[B, Tq, Tk, H]`` intermediate.

Additive attention scores every (query, key) pair with a small network,
``e[b, i, j] = v · tanh(W_q q[b, i] + W_k k[b, j])``, then returns ``softmax_j(e) @ values``.
Written in PyTorch the obvious way, the broadcast sum ``W_q q[:, :, None] + W_k k[:, None]`` and
its ``tanh`` are ``[B, Tq, Tk, H]`` tensors, and autograd keeps the ``tanh`` output for backward.
A seq2seq decoder that attends over ``T`` encoder states at each of its ``T`` steps therefore
keeps ``T² · B · H`` values until backward: Meng et al. (NIPS 2017, "Training Deeper Models by GPU
Memory Optimization on TensorFlow") found this term capped the batch of their model at 2 for
``T = 400`` and raised it to 60 with a fused op that recomputes the block in backward.

How this module does it: two ``torch.library`` custom ops, ``memfit::additive_attention``
(forward, returns the output and the per-row logsumexp of the scores) and
``memfit::additive_attention_backward``, tied together with ``register_autograd``. The projections
``W_q q`` (``[B, Tq, H]``) and ``W_k k`` (``[B, Tk, H]``) are computed once per call; the
``tanh`` block is then computed ``[B, tq, tk, H]`` at a time (the chunk rule is in
:func:`chunk_sizes`), reduced with ``v`` to scores at once, and dropped. Backward recomputes each
block, turns its scores into probabilities with the saved logsumexp (so no full row of
probabilities is ever needed again) and accumulates every gradient block by block.

What is kept for backward: the op's inputs (references, no copies), its output and the logsumexp
``[B, Tq]``. Not the projections: a decoder calls the op once per step with the *same* keys, and
a ``W_k k`` saved per call would be a new ``[B, Tk, H]`` tensor per step, ``T² · B · H`` again.
Backward recomputes them (two matmuls). To avoid projecting the keys at every step in the first
place, pass ``w_keys=None`` with keys already projected (the usual Bahdanau "processed memory",
computed once per sequence); ``w_query=None`` likewise takes a projected query.

Why custom ops rather than an ``autograd.Function``: Dynamo and AOTAutograd see each as one opaque
node whose saved values are the small ones above, so ``torch.compile`` and ``memfit.checkpoint``
keep the memory saving instead of tracing through the loop.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import register_flop_formula

__all__ = ["additive_attention", "AdditiveAttention", "chunk_sizes", "BLOCK_ELEMENTS"]

#: The most elements one ``[B, tq, tk, H]`` tanh block may hold (2^18: 1 MiB in fp32), unless a
#: single (query, key) pair over the whole batch, ``B · H``, is already larger.
BLOCK_ELEMENTS = 1 << 18

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def chunk_sizes(
    batch: int, queries: int, keys: int, hidden: int, block_elements: int = BLOCK_ELEMENTS
) -> tuple[int, int]:
    """``(tq, tk)``: query rows and keys per block so ``batch · tq · tk · hidden`` stays small.

    The rule: take as many keys as fit in ``block_elements`` with one query row,
    ``tk = min(keys, max(1, block_elements // (batch · hidden)))``; then as many query rows as fit
    with those keys, ``tq = min(queries, max(1, block_elements // (batch · tk · hidden)))``.
    A block therefore holds at most ``max(block_elements, batch · hidden)`` elements; the second
    term is the size of one query's projection over the batch, linear like the inputs.
    """
    if block_elements < 1:
        raise ValueError(f"block_elements must be at least 1, got {block_elements}")
    row = max(1, batch * hidden)
    tk = min(max(keys, 1), max(1, block_elements // row))
    tq = min(max(queries, 1), max(1, block_elements // (row * tk)))
    return tq, tk


# ----------------------------------------------------------------------------- kernels


def _project(x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    return x if w is None else x @ w.t()


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _block_scores(
    pq: torch.Tensor, pk: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tanh block ``tanh(pq[:, :, None] + pk[:, None])`` and its scores ``[B, tq, tk]``."""
    block = pq[:, :, None, :] + pk[:, None, :, :]
    block.tanh_()
    return block, block @ v


@torch.library.custom_op("memfit::additive_attention", mutates_args=())
def _forward_op(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    w_query: torch.Tensor | None,
    w_keys: torch.Tensor | None,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    block_elements: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, queries, _ = query.shape
    n_keys, hidden = keys.shape[1], v.shape[0]
    acc = _accumulation_dtype(query.dtype)
    pq, pk = _project(query, w_query), _project(keys, w_keys)
    tq, tk = chunk_sizes(batch, queries, n_keys, hidden, block_elements)
    full_mask = None if mask is None else mask.expand(batch, queries, n_keys)
    out = values.new_empty(batch, queries, values.shape[2])
    lse = torch.empty(batch, queries, dtype=acc, device=query.device)
    for q0 in range(0, queries, tq):
        q1 = min(q0 + tq, queries)
        scores = torch.empty(batch, q1 - q0, n_keys, dtype=acc, device=query.device)
        for k0 in range(0, n_keys, tk):
            k1 = min(k0 + tk, n_keys)
            _, e = _block_scores(pq[:, q0:q1], pk[:, k0:k1], v)
            scores[:, :, k0:k1] = e
            del _, e
        if full_mask is not None:
            scores.masked_fill_(~full_mask[:, q0:q1], float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)
        # A fully masked row has lse = -inf and probabilities NaN, as softmax gives it.
        probs = (scores - row_lse[..., None]).exp_()
        del scores
        out[:, q0:q1] = probs.to(values.dtype) @ values
        lse[:, q0:q1] = row_lse
    return out, lse


# The fakes and FLOP formulas name only the arguments they read (see nn/README.md).
@_forward_op.register_fake
def _forward_fake(
    query: torch.Tensor, _keys: torch.Tensor, values: torch.Tensor, *_: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, queries = query.shape[:2]
    out = values.new_empty(batch, queries, values.shape[2])
    lse = query.new_empty(batch, queries, dtype=_accumulation_dtype(query.dtype))
    return out, lse


@torch.library.custom_op("memfit::additive_attention_backward", mutates_args=())
def _backward_op(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    w_query: torch.Tensor | None,
    w_keys: torch.Tensor | None,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    block_elements: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients for query, keys, values, w_query, w_keys, v (empty for a weight passed as None)."""
    batch, queries, _ = query.shape
    n_keys, hidden = keys.shape[1], v.shape[0]
    acc = lse.dtype
    pq, pk = _project(query, w_query), _project(keys, w_keys)
    tq, tk = chunk_sizes(batch, queries, n_keys, hidden, block_elements)
    full_mask = None if mask is None else mask.expand(batch, queries, n_keys)
    grad_out = grad_out.to(values.dtype)
    # delta[b, i] = sum_j a[b, i, j] * dA[b, i, j] = grad_out[b, i] . out[b, i]
    delta = (grad_out.to(acc) * out.to(acc)).sum(-1)
    d_pq = torch.zeros(batch, queries, hidden, dtype=acc, device=query.device)
    d_pk = torch.zeros(batch, n_keys, hidden, dtype=acc, device=query.device)
    d_values = torch.zeros(values.shape, dtype=acc, device=query.device)
    d_v = torch.zeros(hidden, dtype=acc, device=query.device)
    for q0 in range(0, queries, tq):
        q1 = min(q0 + tq, queries)
        g = grad_out[:, q0:q1]
        for k0 in range(0, n_keys, tk):
            k1 = min(k0 + tk, n_keys)
            block, e = _block_scores(pq[:, q0:q1], pk[:, k0:k1], v)
            e = e.to(acc)
            keep = None if full_mask is None else full_mask[:, q0:q1, k0:k1]
            if keep is not None:
                e.masked_fill_(~keep, float("-inf"))
            probs = (e - lse[:, q0:q1, None]).exp_()  # [B, tq, tk]
            del e
            d_values[:, k0:k1] += (probs.transpose(1, 2).to(values.dtype) @ g).to(acc)
            d_probs = (g @ values[:, k0:k1].transpose(1, 2)).to(acc)
            d_scores = probs.mul_(d_probs.sub_(delta[:, q0:q1, None]))
            del d_probs
            if keep is not None:
                d_scores.masked_fill_(~keep, 0.0)  # as masked_fill's backward does
            d_scores = d_scores.to(block.dtype)
            d_v += (d_scores.reshape(1, -1) @ block.reshape(-1, hidden)).reshape(-1).to(acc)
            # d(pre-tanh) = (d_scores ⊗ v) * (1 - tanh²): two passes over a second block.
            d_pre = d_scores[..., None] * v
            del d_scores
            torch.ops.aten.tanh_backward.grad_input(d_pre, block, grad_input=d_pre)
            del block
            d_pq[:, q0:q1] += d_pre[:, :, 0] if k1 - k0 == 1 else d_pre.sum(2, dtype=acc)
            d_pk[:, k0:k1] += d_pre[:, 0] if q1 - q0 == 1 else d_pre.sum(1, dtype=acc)
            del d_pre
    d_pq_t, d_pk_t = d_pq.to(query.dtype), d_pk.to(keys.dtype)
    # A weight passed as None gets an empty gradient (two distinct ones: outputs may not alias).
    if w_query is None:
        d_query, d_w_query = d_pq_t, query.new_empty(0)
    else:
        d_query = d_pq_t @ w_query
        d_w_query = d_pq_t.reshape(-1, hidden).t() @ query.reshape(-1, query.shape[2])
    if w_keys is None:
        d_keys, d_w_keys = d_pk_t, keys.new_empty(0)
    else:
        d_keys = d_pk_t @ w_keys
        d_w_keys = d_pk_t.reshape(-1, hidden).t() @ keys.reshape(-1, keys.shape[2])
    return d_query, d_keys, d_values.to(values.dtype), d_w_query, d_w_keys, d_v.to(v.dtype)


@_backward_op.register_fake
def _backward_fake(*args: Any) -> tuple[torch.Tensor, ...]:
    _grad_out, query, keys, values, w_query, w_keys, v, *_ = args
    return (
        torch.empty_like(query),
        torch.empty_like(keys),
        torch.empty_like(values),
        query.new_empty(0) if w_query is None else torch.empty_like(w_query),
        keys.new_empty(0) if w_keys is None else torch.empty_like(w_keys),
        torch.empty_like(v),
    )


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    query, keys, values, w_query, w_keys, v, mask, block_elements = inputs
    out, lse = output
    ctx.save_for_backward(query, keys, values, w_query, w_keys, v, mask, out, lse)
    ctx.block_elements = block_elements
    ctx.mark_non_differentiable(lse)


def _autograd_backward(
    ctx: Any, grad_out: torch.Tensor, _grad_lse: torch.Tensor | None
) -> tuple[torch.Tensor | None, ...]:
    query, keys, values, w_query, w_keys, v, mask, out, lse = ctx.saved_tensors
    grads = _backward_op(
        grad_out, query, keys, values, w_query, w_keys, v, mask, out, lse, ctx.block_elements
    )
    d_query, d_keys, d_values, d_w_query, d_w_keys, d_v = grads
    return (
        d_query,
        d_keys,
        d_values,
        None if w_query is None else d_w_query,
        None if w_keys is None else d_w_keys,
        d_v,
        None,
        None,
    )


_forward_op.register_autograd(_autograd_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- FLOPs


def _forward_flops(
    query: torch.Size,
    keys: torch.Size,
    values: torch.Size,
    w_query: torch.Size | None,
    w_keys: torch.Size | None,
    v: torch.Size,
) -> tuple[int, int, int]:
    """FLOPs of one forward, multiply-adds counted as 2: (projections, scores, output).

    The scores are ``tanh(...) @ v``, the contraction over ``H``; the output is
    ``probs @ values``, the contraction over the keys.
    """
    batch, queries, d_query = query
    n_keys, d_keys = keys[1], keys[2]
    hidden, d_values = v[0], values[2]
    proj = 0
    if w_query is not None:
        proj += 2 * batch * queries * d_query * hidden
    if w_keys is not None:
        proj += 2 * batch * n_keys * d_keys * hidden
    return proj, 2 * batch * queries * n_keys * hidden, 2 * batch * queries * n_keys * d_values


def _register_flop_formulas() -> None:
    # The shapes come in the op's argument order, then ``out_shape``.
    @register_flop_formula(torch.ops.memfit.additive_attention)
    def _fwd(*shapes: Any, out_shape: Any = None) -> int:
        return sum(_forward_flops(*shapes[:6]))

    @register_flop_formula(torch.ops.memfit.additive_attention_backward)
    def _bwd(_grad_out: torch.Size, *shapes: Any, out_shape: Any = None) -> int:
        # Recomputed projections and scores, then two FLOPs' worth of gradient per forward FLOP
        # (each contraction's gradient is two contractions of the same size).
        proj, scores, output = _forward_flops(*shapes[:6])
        return proj + scores + 2 * (proj + scores + output)

    del _fwd, _bwd


_register_flop_formulas()


# ----------------------------------------------------------------------------- public API


def _shapes(**tensors: torch.Tensor | None) -> str:
    return ", ".join(
        f"{name} {list(t.shape) if t is not None else None}" for name, t in tensors.items()
    )


def _check(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    w_query: torch.Tensor | None,
    w_keys: torch.Tensor | None,
    v: torch.Tensor,
    mask: torch.Tensor | None,
) -> None:
    named = dict(query=query, keys=keys, values=values, w_query=w_query, w_keys=w_keys, v=v)
    shapes = _shapes(**named, mask=mask)
    for name, t in named.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise ValueError(f"additive_attention: {name} must be a torch.Tensor, got {type(t)}")
    if mask is not None and not isinstance(mask, torch.Tensor):
        raise ValueError(
            f"additive_attention: mask must be a bool tensor or None, got {type(mask)}"
        )

    def fail(rule: str) -> ValueError:
        return ValueError(f"additive_attention: {rule} (got {shapes})")

    if query.dim() != 3 or keys.dim() != 3 or values.dim() != 3 or v.dim() != 1:
        raise fail(
            "expected query [B, Tq, Dq] (or [B, Dq]), keys [B, Tk, Dk], values [B, Tk, Dv], "
            "w_query [H, Dq], w_keys [H, Dk] and v [H]"
        )
    batch, _, d_query = query.shape
    n_keys, d_keys, hidden = keys.shape[1], keys.shape[2], v.shape[0]
    if keys.shape[0] != batch or values.shape[0] != batch:
        raise fail("query, keys and values must have the same batch size B")
    if values.shape[1] != n_keys:
        raise fail("keys and values must have the same number of keys Tk")
    if n_keys == 0:
        raise fail("there must be at least one key")
    if w_query is None:
        if d_query != hidden:
            raise fail("with w_query=None the query is already projected: its last size must be H")
    elif w_query.shape != (hidden, d_query):
        raise fail("w_query must be [H, Dq], with H the size of v and Dq the query's last size")
    if w_keys is None:
        if d_keys != hidden:
            raise fail("with w_keys=None the keys are already projected: their last size must be H")
    elif w_keys.shape != (hidden, d_keys):
        raise fail("w_keys must be [H, Dk], with H the size of v and Dk the keys' last size")
    dtypes = {name: t.dtype for name, t in named.items() if t is not None}
    if len(set(dtypes.values())) != 1 or query.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"additive_attention: query, keys, values, weights and v must share one floating "
            f"dtype (float16, bfloat16, float32 or float64); got {dtypes}; convert them with "
            f".to(dtype)"
        )
    devices = {name: str(t.device) for name, t in named.items() if t is not None}
    if len(set(devices.values())) != 1:
        raise ValueError(f"additive_attention: all tensors must be on one device, got {devices}")
    if mask is not None:
        if mask.dtype != torch.bool:
            raise ValueError(
                f"additive_attention: mask must be bool (True = attend), got {mask.dtype} with "
                f"shape {list(mask.shape)}; pass mask.bool() or a comparison"
            )
        target = (batch, query.shape[1], n_keys)
        if mask.dim() != 3 or any(m not in (1, t) for m, t in zip(mask.shape, target)):
            raise fail(f"mask must broadcast to [B, Tq, Tk] = {list(target)}")
        if str(mask.device) != str(query.device):
            raise ValueError(
                f"additive_attention: mask is on {mask.device}, the other tensors on {query.device}"
            )


def additive_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    w_query: torch.Tensor | None,
    w_keys: torch.Tensor | None,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    block_elements: int = BLOCK_ELEMENTS,
) -> torch.Tensor:
    """``softmax_j(v · tanh(w_query @ query[b, i] + w_keys @ keys[b, j])) @ values``, memory-linear.

    Computes the same values and gradients (for all six tensors) as the naive formula, without
    ever holding more than one ``[B, tq, tk, H]`` block of the ``tanh`` (see :func:`chunk_sizes`)
    in forward or backward, and keeps only the inputs, the output and a ``[B, Tq]`` logsumexp
    for backward.

    Args:
        query: ``[B, Tq, Dq]``, or ``[B, Dq]`` for one decoder step (then the result is
            ``[B, Dv]``).
        keys: ``[B, Tk, Dk]``.
        values: ``[B, Tk, Dv]``.
        w_query: ``[H, Dq]``, or ``None`` if ``query`` is already projected (``Dq == H``).
        w_keys: ``[H, Dk]``, or ``None`` if ``keys`` are already projected (``Dk == H``); a decoder
            that attends over the same keys at every step should project them once and pass
            ``None`` here rather than have every step project them again.
        v: ``[H]``.
        mask: bool, ``True`` = attend, broadcastable to ``[B, Tq, Tk]`` (e.g. ``[B, 1, Tk]`` for
            padding, ``[1, Tq, Tk]`` for a causal mask); a 2-D mask is read as ``[B, Tk]`` (key
            padding per sequence). A row whose keys are all masked gives NaN, as
            ``softmax`` of an all ``-inf`` row does in the naive formula (and its gradients
            match the naive formula's too).
        block_elements: the most elements of one tanh block; the default, 2^18, is 1 MiB fp32.

    Returns:
        ``[B, Tq, Dv]`` (``[B, Dv]`` for a 2-D query), in the inputs' dtype.

    Raises:
        ValueError: shapes that do not agree, dtypes that differ or are not floating, a mask
            that is not bool or does not broadcast; the message names every shape.
    """
    single_step = isinstance(query, torch.Tensor) and query.dim() == 2
    if single_step:
        query = query[:, None, :]
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        mask = mask[:, None, :]
    _check(query, keys, values, w_query, w_keys, v, mask)
    if block_elements < 1:
        raise ValueError(
            f"additive_attention: block_elements must be at least 1, got {block_elements}"
        )
    out, _ = _forward_op(query, keys, values, w_query, w_keys, v, mask, block_elements)
    return out[:, 0] if single_step else out


class AdditiveAttention(torch.nn.Module):
    """Bahdanau attention as a module: parameters ``w_query``, ``w_keys``, ``v``.

    Initialisation follows ``torch.nn.Linear`` (what a Bahdanau layer written with two bias-free
    ``nn.Linear`` layers and a ``v`` vector gets): ``w_query`` and ``w_keys`` uniform in
    ``±1/sqrt(fan_in)`` (``fan_in`` = ``query_dim``, ``key_dim``), ``v`` uniform in
    ``±1/sqrt(hidden_dim)``. No biases: a bias on ``W_q q + W_k k`` would be one more ``[H]``
    vector, which neither Bahdanau et al. nor TensorFlow's ``BahdanauAttention`` (unnormalised)
    use.

    ``forward(query, keys, values=None, mask=None)`` calls :func:`additive_attention`;
    ``values`` default to ``keys``. A decoder attending over the same keys at every step should
    call :meth:`project_keys` once and pass ``projected_keys=`` to each step.
    """

    def __init__(
        self,
        query_dim: int,
        key_dim: int,
        hidden_dim: int,
        *,
        block_elements: int = BLOCK_ELEMENTS,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, size in (
            ("query_dim", query_dim),
            ("key_dim", key_dim),
            ("hidden_dim", hidden_dim),
        ):
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"AdditiveAttention: {name} must be a positive int, got {size!r}")
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.query_dim, self.key_dim, self.hidden_dim = query_dim, key_dim, hidden_dim
        self.block_elements = block_elements
        self.w_query = torch.nn.Parameter(torch.empty(hidden_dim, query_dim, **factory))
        self.w_keys = torch.nn.Parameter(torch.empty(hidden_dim, key_dim, **factory))
        self.v = torch.nn.Parameter(torch.empty(hidden_dim, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform in ``±1/sqrt(fan_in)``, as ``nn.Linear`` initialises its weight's bound."""
        with torch.no_grad():
            self.w_query.uniform_(-(self.query_dim**-0.5), self.query_dim**-0.5)
            self.w_keys.uniform_(-(self.key_dim**-0.5), self.key_dim**-0.5)
            self.v.uniform_(-(self.hidden_dim**-0.5), self.hidden_dim**-0.5)

    def project_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """``W_k k``: ``[B, Tk, H]``, to compute once and pass as ``projected_keys`` every step."""
        return keys @ self.w_keys.t()

    def forward(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        *,
        projected_keys: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend from ``query`` (``[B, Tq, Dq]`` or ``[B, Dq]``) over ``keys``; see the class."""
        values = keys if values is None else values
        if projected_keys is not None:
            return additive_attention(
                query,
                projected_keys,
                values,
                self.w_query,
                None,
                self.v,
                mask,
                block_elements=self.block_elements,
            )
        return additive_attention(
            query,
            keys,
            values,
            self.w_query,
            self.w_keys,
            self.v,
            mask,
            block_elements=self.block_elements,
        )

    def extra_repr(self) -> str:
        return f"query_dim={self.query_dim}, key_dim={self.key_dim}, hidden_dim={self.hidden_dim}"
