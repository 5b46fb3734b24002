"""Attention whose memory grows linearly with sequence length: ``chunked_attention``.

Naive attention, ``softmax(q @ k^T * scale + mask) @ v``, keeps the ``[*B, Lq, Lk]``
probabilities for backward, which is quadratic in the sequence length. PyTorch's fused SDPA
avoids that, but on CPU it silently falls back to the same quadratic math path for dropout, 3-D
inputs, a value head dim different from the query's, or a mask that requires grad, and it knows
only one fixed form of score arithmetic. memfit needs a kernel for those cases that also takes
*arbitrary* elementwise score arithmetic, because its capture pass rewrites whatever naive
attention it finds in a model's graph and must reproduce the model's own ops on the scores.

How: FlashAttention's online softmax, written with ordinary torch ops over blocks of keys.
Forward keeps a running row maximum ``m``, normaliser ``l`` and output accumulator, and saves
only ``out`` and ``logsumexp = m + log l`` (one number per query). Backward (FlashAttention-2)
recomputes each block of scores from q and k, rebuilds the probabilities as
``exp(s - logsumexp)``, and needs only ``delta = rowsum(dO * O)`` besides. The logsumexp is kept
as its two parts, ``(m, log l)`` (see NOTE [Split logsumexp]). The "score ops" (a
chain of ``mul``/``div``/``add``/``fill``) are applied to each block in order in forward and
undone in reverse in backward; a packed dropout keep-mask (``memfit.nn.dropout_mask``) is
unpacked one block at a time. No ``[*B, Lq, Lk]`` tensor is ever created, only
``[*B, Lq, chunk]`` blocks.

Both passes are ``torch.library`` custom ops (``memfit::chunked_attention_fwd`` and
``memfit::chunked_attention_bwd``) joined by ``register_autograd``, so Dynamo and AOTAutograd
see one opaque node each way (not the unrolled chunk loops), saved values are exactly q, k, v,
out, logsumexp, the operands and the packed mask, and memfit's planner and cost model (which
reads ``torch.utils.flop_counter``'s registry, where both ops have FLOP formulas) price them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from memfit.nn.bits import packed_width, unpack_bits

__all__ = ["chunked_attention", "default_chunk_size", "SCORE_OP_KINDS"]

#: The score ops ``chunked_attention`` applies, in the order given, to ``s = q @ k^T``:
#: ``mul``/``div`` by a constant (``operands[i]``, a tensor that does not require grad, or else
#: ``values[i]``), ``add`` a tensor (which may require grad) or a constant, and ``fill``
#: (``s.masked_fill(operands[i], values[i])``, a bool tensor operand).
SCORE_OP_KINDS = ("mul", "div", "add", "fill")

# NOTE [Split logsumexp]
# FlashAttention saves lse = m + log(l) per row and recomputes p = exp(s - lse). When m is huge,
# as in a row filled entirely with finfo.min (naive attention gives it uniform probabilities),
# m + log(l) rounds to m and p would come out as 1 instead of 1/l. So forward returns both parts,
# ``lse[..., 0] = m`` and ``lse[..., 1] = log(l)`` (logsumexp is their sum), and backward computes
# p = exp((s - m) - log(l)). A row of all -inf has m = log(l) = -inf and gets NaN, as softmax does.

#: Smallest score block (bytes) the default chunk size aims for; see ``default_chunk_size``.
_BLOCK_FLOOR_BYTES = 1 << 20

_FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def default_chunk_size(rows: int, head_dim: int, keys: int, element_size: int = 4) -> int:
    """Keys per block when ``chunk_size`` is not given.

    A block of scores ``[rows, chunk]`` (``rows`` = batch x heads x queries) in the compute
    dtype (``element_size`` bytes) may take at most ``max(bytes of q in that dtype, 1 MiB)``,
    that is ``chunk = max(head_dim, 1 MiB / (rows * element_size))``, rounded down to a multiple
    of 8 (whole bytes of a packed dropout mask), at most ``keys``. Why: a block the size of q
    keeps the kernel's working memory (about three blocks in backward) a small multiple of its
    own inputs, so it stays linear in the sequence length, while the per-block matrix products
    ``[Lq, D] x [D, chunk]`` with ``chunk >= D`` stay large enough for BLAS to run at speed.
    The 1 MiB floor keeps short sequences from being cut into many tiny blocks, where the dozen
    small ops per block (tens of microseconds) would cost more than the arithmetic.
    """
    rows, keys = max(int(rows), 1), max(int(keys), 1)
    budget = max(rows * int(head_dim) * element_size, _BLOCK_FLOOR_BYTES)
    chunk = max(1, budget // (rows * element_size))
    if chunk >= 8:
        chunk -= chunk % 8
    return min(chunk, keys)


# ---- the score ops ------------------------------------------------------------------------------


class _ScoreOp(NamedTuple):
    kind: str
    operand: Tensor | None
    value: float
    #: position of ``operand`` in the ops' tensor list (-1 without one)
    slot: int


def _encode(
    kinds: Sequence[str], operands: Sequence[Tensor | None], values: Sequence[float]
) -> str:
    # Custom-op schemas have no str[] and their Tensor?[] lists get no gradients, so the ops
    # take the present operands as a Tensor[] and this string says which op takes the next one
    # and carries its constant exactly (float.hex): "mul:v:0x1.6a09e667f3bcdp-2,add:t:0x0p+0".
    # The constants travel in the string rather than as a float[] argument because autograd
    # checks that backward returns one gradient per input leaf, and a float[] argument is a
    # list under eager dispatch but a single leaf under AOTAutograd's tracing.
    return ",".join(
        f"{k}:{'v' if o is None else 't'}:{float(x).hex()}"
        for k, o, x in zip(kinds, operands, values, strict=True)
    )


def _decode(spec: str, operands: Sequence[Tensor]) -> list[_ScoreOp]:
    ops: list[_ScoreOp] = []
    index = 0
    for item in spec.split(",") if spec else []:
        kind, source, value = item.split(":")
        if source == "t":
            ops.append(_ScoreOp(kind, operands[index], float.fromhex(value), index))
            index += 1
        else:
            ops.append(_ScoreOp(kind, None, float.fromhex(value), -1))
    return ops


def _keys(t: Tensor, start: int, stop: int) -> Tensor:
    """The part of a score-shaped operand that covers keys ``start:stop`` (all of it if it
    broadcasts over keys)."""
    return t[..., start:stop] if t.dim() >= 1 and t.shape[-1] != 1 else t


def _constant(op: _ScoreOp, start: int, stop: int, dtype: torch.dtype) -> Tensor | float:
    """The op's ``c`` for keys ``start:stop``: its value, or its operand's part there, floating
    operands in the compute dtype (scores stay in it whatever the operands' dtypes)."""
    if op.operand is None:
        return op.value
    part = _keys(op.operand, start, stop)
    return part.to(dtype) if part.is_floating_point() else part


def _apply_ops(s: Tensor, ops: Sequence[_ScoreOp], start: int, stop: int) -> Tensor:
    """Apply the score ops, in order and in place, to a block ``s`` of scores (keys
    ``start:stop``)."""
    for op in ops:
        arg = _constant(op, start, stop, s.dtype)
        if op.kind == "fill":
            assert isinstance(arg, Tensor)
            s = s.masked_fill_(arg, op.value)
        elif op.kind == "mul":
            s = s.mul_(arg)
        elif op.kind == "div":
            s = s.div_(arg)
        else:
            s = s.add_(arg)
    return s


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk(chunk_size: int, q: Tensor, keys: int) -> int:
    if chunk_size > 0:
        return min(chunk_size, max(keys, 1))
    rows = q.numel() // max(q.shape[-1], 1)
    size = torch.finfo(_compute_dtype(q.dtype)).bits // 8
    return default_chunk_size(rows, q.shape[-1], keys, size)


# ---- forward -----------------------------------------------------------------------------------


@torch.library.custom_op("memfit::chunked_attention_fwd", mutates_args=())
def _fwd_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    spec: str,
    operands: Sequence[Tensor],
    dropout_p: float,
    dropout_mask: Tensor | None,
    chunk_size: int,
) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of attention over key blocks (online softmax); ``lse[..., 0]`` is each
    row's maximum score m, ``lse[..., 1]`` the log of its normaliser (NOTE [Split logsumexp])."""
    ops = _decode(spec, operands)
    cdt = _compute_dtype(q.dtype)
    lead, lq, lk, dv = q.shape[:-2], q.shape[-2], k.shape[-2], v.shape[-1]
    qc = q.to(cdt)
    m = torch.full((*lead, lq, 1), -math.inf, dtype=cdt, device=q.device)
    norm = torch.zeros((*lead, lq, 1), dtype=cdt, device=q.device)
    acc = torch.zeros((*lead, lq, dv), dtype=cdt, device=q.device)
    chunk = _chunk(chunk_size, q, lk)
    for start in range(0, lk, chunk):
        stop = min(start + chunk, lk)
        s = torch.matmul(qc, k[..., start:stop, :].to(cdt).mT)
        s = _apply_ops(s, ops, start, stop)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        # A row whose scores so far are all -inf has m_new = -inf; subtracting 0 instead keeps
        # exp(-inf - -inf) = NaN out of its (zero) sums, so -inf rows end as 0/0 = NaN, exactly
        # as softmax gives for them.
        shift = m_new.masked_fill(m_new == -math.inf, 0.0)
        p = s.sub_(shift).exp_()
        alpha = (m - shift).exp_()
        norm.mul_(alpha).add_(p.sum(-1, keepdim=True))
        if dropout_mask is not None:
            p = p.mul_(unpack_bits(dropout_mask, stop - start, start))
        acc.mul_(alpha).add_(torch.matmul(p, v[..., start:stop, :].to(cdt)))
        m = m_new
        del s, p
    if dropout_mask is not None:
        acc.mul_(1.0 / (1.0 - dropout_p))
    out = acc.div_(norm).to(v.dtype)
    return out, torch.cat([m, norm.log_()], dim=-1)


@_fwd_op.register_fake  # it names only the arguments it reads (see nn/README.md)
def _fwd_fake(q: Tensor, _k: Tensor, v: Tensor, *_: Any) -> tuple[Tensor, Tensor]:
    out = q.new_empty((*q.shape[:-1], v.shape[-1]), dtype=v.dtype)
    return out, q.new_empty((*q.shape[:-1], 2), dtype=_compute_dtype(q.dtype))


# ---- backward ----------------------------------------------------------------------------------


@torch.library.custom_op("memfit::chunked_attention_bwd", mutates_args=())
def _bwd_op(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    spec: str,
    operands: Sequence[Tensor],
    dropout_p: float,
    dropout_mask: Tensor | None,
    chunk_size: int,
    operand_needs_grad: Sequence[bool],
) -> list[Tensor]:
    """``[dq, dk, dv, *grads of the operands with operand_needs_grad]`` (FlashAttention-2)."""
    ops = _decode(spec, operands)
    cdt = _compute_dtype(q.dtype)
    lk = k.shape[-2]
    qc, do = q.to(cdt), grad_out.to(cdt)
    delta = (do * out.to(cdt)).sum(-1, keepdim=True)
    row_max, log_norm = lse[..., :1], lse[..., 1:]
    dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
    dk = torch.empty(k.shape, dtype=cdt, device=k.device)
    dv = torch.empty(v.shape, dtype=cdt, device=v.device)
    grads = {
        i: torch.zeros(t.shape, dtype=cdt, device=t.device)
        for i, (t, n) in enumerate(zip(operands, operand_needs_grad))
        if n
    }
    scale = 1.0 / (1.0 - dropout_p) if dropout_mask is not None else 1.0
    chunk = _chunk(chunk_size, q, lk)
    for start in range(0, lk, chunk):
        stop = min(start + chunk, lk)
        kc, vc = k[..., start:stop, :].to(cdt), v[..., start:stop, :].to(cdt)
        s = _apply_ops(torch.matmul(qc, kc.mT), ops, start, stop)
        p = s.sub_(row_max).sub_(log_norm).exp_()
        keep = None
        if dropout_mask is not None:
            keep = unpack_bits(dropout_mask, stop - start, start)
            dv[..., start:stop, :] = torch.matmul((p * keep).mT, do).mul_(scale)
        else:
            dv[..., start:stop, :] = torch.matmul(p.mT, do)
        dp = torch.matmul(do, vc.mT)
        if keep is not None:
            dp = dp.mul_(keep).mul_(scale)
            del keep
        ds = dp.sub_(delta).mul_(p)
        del p, s
        for op in reversed(ops):  # back through the score ops: d(scores) before each op
            if op.kind == "fill":
                assert op.operand is not None
                ds = ds.masked_fill_(_keys(op.operand, start, stop), 0.0)
            elif op.kind == "add":
                if op.slot in grads:
                    assert op.operand is not None
                    part = _keys(op.operand, start, stop)
                    _keys(grads[op.slot], start, stop).add_(ds.sum_to_size(part.shape))
            elif op.kind == "mul":
                ds = ds.mul_(_constant(op, start, stop, cdt))
            else:
                ds = ds.div_(_constant(op, start, stop, cdt))
        dq.add_(torch.matmul(ds, kc))
        dk[..., start:stop, :] = torch.matmul(ds.mT, qc)
        del ds, dp
    result = [dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)]
    result += [grads[i].to(operands[i].dtype) for i in sorted(grads)]
    return result


@_bwd_op.register_fake
def _bwd_fake(*args: Any) -> list[Tensor]:
    _grad_out, q, k, v, _out, _lse, _spec, operands, *_, operand_needs_grad = args
    grads = [t.new_empty(t.shape) for t, n in zip(operands, operand_needs_grad) if n]
    return [q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), *grads]


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, spec, operands, dropout_p, dropout_mask, chunk_size = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, dropout_mask, *operands)
    ctx.mark_non_differentiable(lse)
    ctx.spec, ctx.dropout_p, ctx.chunk_size = spec, dropout_p, chunk_size


def _backward(ctx: Any, grad_out: Tensor, _grad_lse: Tensor | None) -> tuple[Any, ...]:
    q, k, v, out, lse, dropout_mask, *operands = ctx.saved_tensors
    operand_needs = [bool(n) for n in ctx.needs_input_grad[4]]
    grads = _bwd_op(
        grad_out, q, k, v, out, lse, ctx.spec, operands, ctx.dropout_p,
        dropout_mask, ctx.chunk_size, operand_needs,
    )  # fmt: skip
    dq, dk, dv, *rest = grads
    it = iter(rest)
    operand_grads = [next(it) if n else None for n in operand_needs]
    needs = ctx.needs_input_grad
    return (
        dq if needs[0] else None,
        dk if needs[1] else None,
        dv if needs[2] else None,
        None,
        operand_grads,
        None,
        None,
        None,
    )


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# ---- FLOPs --------------------------------------------------------------------------------------


def _batch_lq_lk_d_dv(q: Sequence[int], k: Sequence[int], v: Sequence[int]) -> tuple[int, ...]:
    return math.prod(q[:-2]), q[-2], k[-2], q[-1], v[-1]


@register_flop_formula(torch.ops.memfit.chunked_attention_fwd)
def _fwd_flops(
    q: Sequence[int], k: Sequence[int], v: Sequence[int], *args: Any, **kwargs: Any
) -> int:
    """``q @ k^T`` and ``p @ v``: 2 * B * Lq * Lk * (D + Dv); elementwise work is not counted."""
    b, lq, lk, d, dv = _batch_lq_lk_d_dv(q, k, v)
    return 2 * b * lq * lk * (d + dv)


@register_flop_formula(torch.ops.memfit.chunked_attention_bwd)
def _bwd_flops(
    grad_out: Sequence[int], q: Sequence[int], k: Sequence[int], v: Sequence[int], *args: Any,
    **kwargs: Any,
) -> int:  # fmt: skip
    """Recomputing ``q @ k^T`` (D), then ``dV = P^T dO`` (Dv), ``dP = dO V^T`` (Dv),
    ``dQ = dS K`` (D) and ``dK = dS^T Q`` (D): 2 * B * Lq * Lk * (3 D + 2 Dv)."""
    b, lq, lk, d, dv = _batch_lq_lk_d_dv(q, k, v)
    return 2 * b * lq * lk * (3 * d + 2 * dv)


# ---- the public function -----------------------------------------------------------------------


def chunked_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kinds: Sequence[str] = (),
    operands: Sequence[Tensor | None] = (),
    values: Sequence[float] = (),
    *,
    dropout_p: float = 0.0,
    dropout_mask: Tensor | None = None,
    chunk_size: int | None = None,
) -> Tensor:
    """Attention ``softmax(ops(q @ k^T)) @ v`` whose memory is linear in the sequence length.

    Args:
        q: queries ``[*B, Lq, D]`` (``*B``: any number of leading dims, none included).
        k: keys ``[*B, Lk, D]``.
        v: values ``[*B, Lk, Dv]``; ``Dv`` may differ from ``D``. q, k and v share one dtype:
            float32, float64, bfloat16 or float16. Scores and softmax are computed in float32
            (float64 for float64 inputs); the output has v's dtype.
        kinds: the score ops, applied in this order to ``s = q @ k^T`` before the softmax (see
            ``SCORE_OP_KINDS``): ``"mul"``/``"div"`` (``s * c``, ``s / c``), ``"add"``
            (``s + c``) and ``"fill"`` (``s.masked_fill(operands[i], values[i])``). No scale is
            applied unless asked for: SDPA's ``1/sqrt(D)`` is ``("mul",), (None,), (D**-0.5,)``.
        operands: per op, a tensor broadcastable to ``[*B, Lq, Lk]`` or None. ``c`` is the
            tensor when given, else ``values[i]``. Only ``add`` operands may require grad (they
            then get gradients reduced to their own shape); ``fill`` takes a bool tensor.
        values: per op, the constant (for ``fill``, the fill value: -inf, finfo.min, ...).
        dropout_p: dropout probability on the attention probabilities, in [0, 1).
        dropout_mask: with ``dropout_p > 0``, the packed keep-mask, uint8
            ``[*B, Lq, ceil(Lk / 8)]`` (``memfit.nn.attention_dropout_mask``); probabilities
            become ``p * keep / (1 - dropout_p)``, as ``F.dropout`` makes them.
        chunk_size: keys per block; None picks ``default_chunk_size``.

    Returns:
        ``[*B, Lq, Dv]``, v's dtype. Rows whose scores are all -inf are NaN, as with softmax.

    Raises:
        ValueError: for inputs of the wrong rank, shape, dtype or device, an unknown score op,
            lists of different lengths, a mul/div/fill operand that requires grad, an operand
            that does not broadcast to the scores, ``dropout_p`` outside [0, 1), or a dropout
            mask that is missing, unexpected, or of the wrong shape or dtype.
    """
    _check_inputs(q, k, v)
    score_shape = (*q.shape[:-1], k.shape[-2])
    present = _check_ops(kinds, operands, values, score_shape, q.device)
    mask = _check_dropout(dropout_p, dropout_mask, score_shape)
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    out, _ = torch.ops.memfit.chunked_attention_fwd(
        q, k, v, _encode(kinds, operands, values), present,
        float(dropout_p), mask, chunk_size or 0,
    )  # fmt: skip
    return out


def _check_inputs(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.dim() < 2 or k.dim() != q.dim() or v.dim() != q.dim():
        raise ValueError(
            f"q, k and v need the same rank, at least 2 ([*B, L, D]); got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[:-2] != k.shape[:-2] or q.shape[:-2] != v.shape[:-2]:
        raise ValueError(
            f"q, k and v need the same leading dims; got shapes {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)} (expand k and v to q's heads first)"
        )
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"need q [*B, Lq, D], k [*B, Lk, D], v [*B, Lk, Dv]; got shapes {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.dtype not in _FLOAT_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"q, k and v need one dtype among {', '.join(map(str, _FLOAT_DTYPES))}; got "
            f"{q.dtype}, {k.dtype}, {v.dtype}"
        )
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v are on different devices: {q.device}, {k.device}, {v.device}")


def _check_ops(
    kinds: Sequence[str],
    operands: Sequence[Tensor | None],
    values: Sequence[float],
    score_shape: tuple[int, ...],
    device: torch.device,
) -> list[Tensor]:
    if isinstance(kinds, str) or not len(kinds) == len(operands) == len(values):
        raise ValueError(
            f"kinds, operands and values need one entry per score op (equal lengths); got "
            f"kinds={kinds!r} ({len(kinds)}), {len(operands)} operands, {len(values)} values"
        )
    present = []
    for i, (kind, operand) in enumerate(zip(kinds, operands)):
        if kind not in SCORE_OP_KINDS:
            raise ValueError(f"score op {i} is {kind!r}; the kinds are {', '.join(SCORE_OP_KINDS)}")
        if operand is None:
            if kind == "fill":
                raise ValueError(f"score op {i} ('fill') needs a bool tensor operand, got None")
            continue
        if not isinstance(operand, Tensor):
            raise ValueError(
                f"score op {i} ({kind!r}): operands[{i}] must be a tensor or None, got "
                f"{type(operand).__name__}; put constants in values[{i}]"
            )
        if kind == "fill" and operand.dtype != torch.bool:
            raise ValueError(f"score op {i} ('fill') needs a bool operand, got {operand.dtype}")
        if kind != "fill" and (operand.dtype == torch.bool or operand.is_complex()):
            raise ValueError(
                f"score op {i} ({kind!r}) needs a real numeric operand, got {operand.dtype}"
            )
        if kind != "add" and operand.requires_grad:
            raise ValueError(
                f"score op {i} ({kind!r}): its operand requires grad, which only 'add' operands "
                f"may; detach it, or express a learnable term as an 'add'"
            )
        try:
            broadcast = torch.broadcast_shapes(operand.shape, score_shape)
        except RuntimeError:
            broadcast = None
        if broadcast != torch.Size(score_shape):
            raise ValueError(
                f"score op {i} ({kind!r}): operand of shape {tuple(operand.shape)} does not "
                f"broadcast to the scores' shape {tuple(score_shape)}"
            )
        if operand.device != device:
            raise ValueError(
                f"score op {i} ({kind!r}): operand is on {operand.device}, q on {device}"
            )
        present.append(operand)
    for i, value in enumerate(values):
        if not isinstance(value, (int, float)):
            raise ValueError(f"values[{i}] must be a float, got {type(value).__name__} {value!r}")
    return present


def _check_dropout(
    dropout_p: float, dropout_mask: Tensor | None, score_shape: tuple[int, ...]
) -> Tensor | None:
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    expected = (*score_shape[:-1], packed_width(score_shape[-1]))
    if dropout_p == 0.0:
        if dropout_mask is not None:
            raise ValueError(
                "a dropout_mask was given with dropout_p=0; pass the probability it was drawn "
                "with, or no mask"
            )
        return None
    if dropout_mask is None:
        raise ValueError(
            f"dropout_p={dropout_p} needs a dropout_mask (uint8 {expected}, from "
            f"memfit.nn.attention_dropout_mask)"
        )
    if dropout_mask.dtype != torch.uint8 or tuple(dropout_mask.shape) != expected:
        raise ValueError(
            f"dropout_mask must be a packed keep-mask, uint8 of shape {expected} for scores "
            f"{tuple(score_shape)}; got {dropout_mask.dtype} {tuple(dropout_mask.shape)}"
        )
    return dropout_mask
