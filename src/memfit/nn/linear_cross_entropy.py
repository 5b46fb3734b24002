"""A language model's loss head without its logits: ``linear_cross_entropy``.

``F.cross_entropy(F.linear(h, W, b), target)`` over N tokens and a vocabulary of V builds the
``[N, V]`` logits, keeps a ``[N, V]`` log-softmax for backward, and builds ``[N, V]`` gradients of
both in backward. Once the layers below are checkpointed, that is most of what a language model
holds per sample: a 12-layer Llama (hidden 128, vocab 2048) at batch 8, sequence 128 has 8 MiB of
fp32 logits against a per-layer checkpoint of 0.5 MiB, and cross-entropy's own copies of them
come on top. The head's memory is linear in ``N * V``; its inputs and outputs are only
``N * D + V * D``.

How (as Liger Kernel's fused linear cross-entropy and Cut Cross-Entropy do): over chunks of
tokens, forward computes each chunk's logits, its per-token logsumexp and the picked logit, and
keeps only the logsumexp (one number per token) with the inputs. Backward computes each chunk's
logits again, turns them into ``softmax - onehot(target)`` scaled by the loss's gradient (divided
by the number of counted tokens for ``"mean"``), and from that chunk of logit gradients adds the
chunk's rows of ``dh`` and its share of ``dW`` (and ``db``). No tensor of ``[N, V]`` elements is
ever built, only ``[chunk, V]`` blocks: one extra ``h @ W^T`` in backward buys it.

Rounding follows plain PyTorch: a chunk's logits come out of ``F.linear`` in the inputs' dtype
(bf16 logits are bf16-rounded, as a model's would be), the softmax is computed in float32
(float64 for float64 inputs; plain PyTorch computes bf16 cross-entropy in bf16, so there this
kernel is the more accurate of the two), and the logit gradients are cast back to the inputs'
dtype before the two matrix products, as autograd casts them through a model's ``.float()``.

Both passes are ``torch.library`` custom ops (``memfit::linear_cross_entropy_fwd`` and
``memfit::linear_cross_entropy_bwd``) joined by ``register_autograd``, so Dynamo and AOTAutograd
see one node each way, with exact sizes under fake tensors, and what is saved for backward is
h, W, b, the targets and the logsumexp; FLOP formulas are registered for the cost model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

__all__ = ["linear_cross_entropy", "default_token_chunk", "working_bytes", "REDUCTIONS"]

#: The reductions the kernel computes: the sum of the counted tokens' losses, or their mean.
REDUCTIONS = ("mean", "sum")

#: Smallest logits block (bytes) the default chunk aims for; see ``default_token_chunk``.
_BLOCK_FLOOR_BYTES = 1 << 20

_FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def default_token_chunk(tokens: int, hidden: int, vocab: int, element_size: int = 4) -> int:
    """Tokens per chunk when ``chunk_size`` is not given.

    A chunk's logits ``[chunk, vocab]`` in the compute dtype (``element_size`` bytes) may take at
    most ``max(bytes of h in that dtype, 1 MiB)``, as Liger Kernel sizes its chunks: the
    kernel's working memory (two or three such blocks) stays a small multiple of its own input,
    and the chunk's matrix products ``[chunk, D] x [D, V]`` stay large enough for BLAS to run at
    speed. The 1 MiB floor keeps small heads from being cut into many tiny products. For vocab
    2048 in float32 that is 128 tokens a chunk; for Llama 3's 128256 and 4096 tokens of width
    4096 (h: 64 MiB), 130.
    """
    tokens, vocab = max(int(tokens), 1), max(int(vocab), 1)
    budget = max(tokens * int(hidden) * element_size, _BLOCK_FLOOR_BYTES)
    return min(max(1, budget // (vocab * element_size)), tokens)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk(chunk_size: int, h: Tensor, vocab: int) -> int:
    return _chunk_tokens(chunk_size, h.shape[0], h.shape[1], vocab, h.dtype)


def _chunk_tokens(chunk_size: int, tokens: int, hidden: int, vocab: int, dtype: torch.dtype) -> int:
    """Tokens per chunk: ``chunk_size`` (at most all of them), or ``default_token_chunk`` at the
    compute dtype's size when it is 0."""
    if chunk_size > 0:
        return min(chunk_size, max(tokens, 1))
    size = torch.finfo(_compute_dtype(dtype)).bits // 8
    return default_token_chunk(tokens, hidden, vocab, size)


def _logits(h: Tensor, weight: Tensor, bias: Tensor | None, cdt: torch.dtype) -> Tensor:
    """One chunk's logits as the model computes them (``F.linear`` in the inputs' dtype), in the
    compute dtype."""
    return F.linear(h, weight, bias).to(cdt)


def working_bytes(
    tokens: int,
    hidden: int,
    vocab: int,
    dtype: torch.dtype,
    chunk_size: int = 0,
    *,
    backward: bool,
    need_weight: bool = True,
    bias: bool = False,
) -> int:
    """Bytes one pass of the kernel allocates beyond its outputs while it runs, for a planner
    that cannot run it (a model on fake tensors: ``analysis.op_scratch.SCRATCH_RULES``).

    A chunk's logits ``[chunk, vocab]`` in the compute dtype, and, where the inputs are in
    another dtype (bf16), the block ``F.linear`` returns in theirs beside it; in backward the
    logit gradients cast back to the inputs' dtype while the compute-dtype block is alive, or
    that cast with ``dW``'s chunk product ``[vocab, hidden]``, and ``dW`` (``db``) accumulated
    in the compute dtype for the whole pass. Plus an allowance for the per-token vectors (mask,
    picked logit, row maximum: ``[chunk]`` each). Measured on CPU against the running kernel:
    within 10 KiB in float32; in bf16 at most 14% above (oneDNN's own matmul scratch comes on
    top on CPU and is not counted).
    """
    h_size = torch.finfo(dtype).bits // 8
    c_size = torch.finfo(_compute_dtype(dtype)).bits // 8
    chunk = _chunk_tokens(chunk_size, tokens, hidden, vocab, dtype)
    block = chunk * vocab
    small = 16 * chunk + 2048
    cast = h_size != c_size
    if not backward:
        return block * (c_size + (h_size if cast else 0)) + small
    summed = vocab * c_size if bias else 0  # ``db``'s chunk sum
    if not cast:
        return block * c_size + summed + small
    product = vocab * hidden * h_size if need_weight else 0
    peak = max(block * (c_size + h_size), block * h_size + product)
    accumulated = (vocab * hidden if need_weight else 0) + (vocab if bias else 0)
    return peak + accumulated * c_size + summed + small


# ---- forward -----------------------------------------------------------------------------------


@torch.library.custom_op("memfit::linear_cross_entropy_fwd", mutates_args=())
def _fwd_op(
    h: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    ignore_index: int,
    reduction: str,
    chunk_size: int,
) -> tuple[Tensor, Tensor]:
    """``(loss, lse)``: the reduced loss in the compute dtype and each token's logsumexp."""
    cdt = _compute_dtype(h.dtype)
    n = h.shape[0]
    lse = torch.empty(n, dtype=cdt, device=h.device)
    total = torch.zeros((), dtype=cdt, device=h.device)
    chunk = _chunk(chunk_size, h, weight.shape[0])
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        logits = _logits(h[start:stop], weight, bias, cdt)
        t = target[start:stop]
        counted = t != ignore_index
        picked = logits.gather(1, t.masked_fill(~counted, 0).unsqueeze(1)).squeeze(1)
        # logsumexp in place (torch.logsumexp would allocate a second block for its exp); a row
        # whose maximum is infinite is shifted by 0, as torch.logsumexp does
        row_max = logits.amax(dim=-1)
        shift = row_max.masked_fill(row_max.isinf(), 0.0)
        part = logits.sub_(shift.unsqueeze(1)).exp_().sum(-1).log_().add_(shift)
        del logits
        total.add_(torch.where(counted, part - picked, 0.0).sum())
        lse[start:stop] = part
    if reduction == "mean":
        total = total / (target != ignore_index).sum()
    return total, lse


@_fwd_op.register_fake  # it names only the arguments it reads (see nn/README.md)
def _fwd_fake(h: Tensor, *_: Any) -> tuple[Tensor, Tensor]:
    cdt = _compute_dtype(h.dtype)
    return h.new_empty((), dtype=cdt), h.new_empty((h.shape[0],), dtype=cdt)


# ---- backward ----------------------------------------------------------------------------------


@torch.library.custom_op("memfit::linear_cross_entropy_bwd", mutates_args=())
def _bwd_op(
    grad_loss: Tensor,
    h: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    lse: Tensor,
    ignore_index: int,
    reduction: str,
    chunk_size: int,
    needs_grad: Sequence[bool],
) -> list[Tensor]:
    """The gradients of h, weight and bias, each only where ``needs_grad`` says, in that order."""
    cdt = _compute_dtype(h.dtype)
    n, vocab = h.shape[0], weight.shape[0]
    scale = grad_loss.to(cdt)
    if reduction == "mean":
        scale = scale / (target != ignore_index).sum()
    need_h, need_w, need_b = needs_grad
    need_b = need_b and bias is not None
    dh = torch.empty(h.shape, dtype=h.dtype, device=h.device) if need_h else None
    dw = torch.zeros(weight.shape, dtype=cdt, device=h.device) if need_w else None
    db = torch.zeros((vocab,), dtype=cdt, device=h.device) if need_b else None
    chunk = _chunk(chunk_size, h, vocab)
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        hc, t = h[start:stop], target[start:stop]
        counted = t != ignore_index
        # softmax - onehot(target), for counted tokens only, times d(loss)/d(token's loss)
        g = _logits(hc, weight, bias, cdt).sub_(lse[start:stop].unsqueeze(1)).exp_()
        g.scatter_add_(1, t.masked_fill(~counted, 0).unsqueeze(1), counted.to(cdt).neg_()[:, None])
        g.mul_(counted.unsqueeze(1)).mul_(scale)
        gl = g.to(h.dtype)  # the logits' gradient in the logits' dtype, as autograd has it
        del g
        if db is not None:
            db.add_(gl.sum(0, dtype=cdt))
        if dh is not None:
            torch.matmul(gl, weight, out=dh[start:stop])
        if dw is not None:
            if gl.dtype == cdt:
                dw.addmm_(gl.mT, hc)
            else:
                dw.add_(torch.matmul(gl.mT, hc))
        del gl
    grads = [dh, dw, db]
    return [g if g.dtype == h.dtype else g.to(h.dtype) for g in grads if g is not None]


@_bwd_op.register_fake
def _bwd_fake(*args: Any) -> list[Tensor]:
    _grad_loss, h, weight, bias, *_, needs_grad = args
    need_h, need_w, need_b = needs_grad
    out = [h.new_empty(h.shape)] if need_h else []
    if need_w:
        out.append(weight.new_empty(weight.shape))
    if need_b and bias is not None:
        out.append(bias.new_empty(bias.shape))
    return out


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    h, weight, bias, target, ignore_index, reduction, chunk_size = inputs
    _, lse = output
    ctx.save_for_backward(h, weight, bias, target, lse)
    ctx.mark_non_differentiable(lse)
    ctx.ignore_index, ctx.reduction, ctx.chunk_size = ignore_index, reduction, chunk_size


def _backward(ctx: Any, grad_loss: Tensor, _grad_lse: Tensor | None) -> tuple[Any, ...]:
    h, weight, bias, target, lse = ctx.saved_tensors
    needs = [bool(n) for n in ctx.needs_input_grad[:3]]
    needs[2] = needs[2] and bias is not None
    grads = iter(
        _bwd_op(
            grad_loss, h, weight, bias, target, lse, ctx.ignore_index, ctx.reduction,
            ctx.chunk_size, needs,
        )
    )  # fmt: skip
    dh, dw, db = (next(grads) if n else None for n in needs)
    return dh, dw, db, None, None, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# ---- FLOPs --------------------------------------------------------------------------------------


@register_flop_formula(torch.ops.memfit.linear_cross_entropy_fwd)
def _fwd_flops(h: Sequence[int], weight: Sequence[int], *args: Any, **kwargs: Any) -> int:
    """``h @ W^T``: 2 * N * D * V; the softmax's elementwise work is not counted."""
    return 2 * h[0] * h[1] * weight[0]


@register_flop_formula(torch.ops.memfit.linear_cross_entropy_bwd)
def _bwd_flops(
    grad_loss: Sequence[int], h: Sequence[int], weight: Sequence[int], *args: Any, **kwargs: Any
) -> int:
    """The logits again, ``dh = G W`` and ``dW = G^T h``: 6 * N * D * V."""
    return 6 * h[0] * h[1] * weight[0]


# ---- the public function -----------------------------------------------------------------------


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_size: int | None = None,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias).to(dtype), target, ...)`` without ever
    building the ``[tokens, vocab]`` logits or their gradient.

    Args:
        hidden: the head's input ``[*T, D]`` (``*T``: the token dims, any number, none included).
        weight: the head's weight ``[V, D]``, hidden's dtype: float32, float64, bfloat16 or
            float16.
        target: class indices ``[*T]`` (an integer dtype), each in ``[0, V)`` or
            ``ignore_index``.
        bias: the head's bias ``[V]`` or None.
        ignore_index: tokens whose target is this count for nothing (``F.cross_entropy``'s).
        reduction: ``"mean"`` (over the tokens counted; NaN when none is) or ``"sum"``.
        chunk_size: tokens per chunk; None picks ``default_token_chunk``.
        dtype: the logits' dtype as the loss sees them (a model's ``logits.float()``), which is
            the loss's dtype; None: hidden's dtype, as ``F.linear`` returns them.

    Returns:
        The loss, a 0-dim tensor of ``dtype`` that backpropagates to hidden, weight and bias.

    Raises:
        ValueError: for shapes that do not match, dtypes other than the above (or differing
            between hidden, weight and bias), a reduction other than ``"mean"``/``"sum"``, or a
            ``chunk_size`` that is not a positive int.
    """
    _check(hidden, weight, target, bias, reduction, chunk_size)
    loss, _ = torch.ops.memfit.linear_cross_entropy_fwd(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, target.reshape(-1),
        int(ignore_index), reduction, chunk_size or 0,
    )  # fmt: skip
    return loss.to(dtype or hidden.dtype)


def _check(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None,
    reduction: str,
    chunk_size: int | None,
) -> None:
    if hidden.dim() < 1 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear_cross_entropy needs hidden [*T, D] and weight [V, D]; got shapes "
            f"{tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"target must have hidden's token dims {tuple(hidden.shape[:-1])}, got "
            f"{tuple(target.shape)} (flatten both, or shift the labels before the call)"
        )
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise ValueError(
            f"target holds class indices (an integer dtype), got {target.dtype}; class "
            f"probabilities are not supported, use F.cross_entropy for them"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [V] = ({weight.shape[0]},), got shape {tuple(bias.shape)}")
    dtypes = [hidden.dtype, weight.dtype] + ([] if bias is None else [bias.dtype])
    if hidden.dtype not in _FLOAT_DTYPES or len(set(dtypes)) != 1:
        raise ValueError(
            f"hidden, weight and bias need one dtype among "
            f"{', '.join(map(str, _FLOAT_DTYPES))}; got {', '.join(map(str, dtypes))}"
        )
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"reduction must be one of {REDUCTIONS}, got {reduction!r}; for per-token losses "
            f"use F.cross_entropy (the [tokens, vocab] logits are then built)"
        )
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
