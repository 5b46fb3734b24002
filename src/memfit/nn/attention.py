"""``memfit.nn.attention``: scaled dot-product attention that never keeps an L x L tensor.

PyTorch's ``F.scaled_dot_product_attention`` picks a fused kernel (FlashAttention and friends:
memory linear in the sequence length) when it can, and otherwise falls back *silently* to its
math path, which stores the [.., Lq, Lk] probabilities for backward. On CPU in torch 2.13 that
happens for dropout, 3-D inputs, a value head dim different from the query's, a mask requiring
grad, and key/value batch dims that broadcast. At L = 4096 the difference is 32 MB against a GB.

This module decides up front which kernel applies. Where SDPA's fused path does, SDPA runs
under ``sdpa_kernel`` restricted to the fused backends, so a wrong guess raises instead of
quietly taking the math path; everywhere else memfit's own chunked kernel
(``memfit.nn.chunked_attention``) runs, with dropout masks drawn exactly as eager dropout draws
them (``memfit.nn.dropout_mask``). The capture pass (``memfit.capture.attention``) uses the same
decision for the naive attention it finds in models.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from memfit.nn.chunked_attention import chunked_attention
from memfit.nn.dropout_mask import attention_dropout_mask

__all__ = ["attention", "fused_sdpa", "why_not_fused_sdpa", "FUSED_BACKENDS"]

#: The SDPA backends whose saved memory is linear in the sequence length (math is not one).
FUSED_BACKENDS = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.CUDNN_ATTENTION,
]
_CPU_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def why_not_fused_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    enable_gqa: bool = False,
) -> str | None:
    """Why SDPA would take its O(L^2) math path for these inputs, or None when a fused one runs.

    On CUDA this asks torch itself (``torch.backends.cuda.can_use_*``). On CPU, where torch has
    no public predicate, it states the flash kernel's conditions as torch 2.13 checks them
    (``sdp_utils_cpp.cpp``); each was confirmed by forcing the flash backend (tests).
    """
    if q.device.type == "cuda":
        params = torch.backends.cuda.SDPAParams(
            q, k, v, attn_mask, dropout_p, is_causal, enable_gqa
        )
        checks = (
            torch.backends.cuda.can_use_flash_attention,
            torch.backends.cuda.can_use_efficient_attention,
            torch.backends.cuda.can_use_cudnn_attention,
        )
        if any(check(params, False) for check in checks):
            return None
        return "no fused SDPA kernel accepts these inputs on CUDA"
    if q.device.type != "cpu":
        return f"fused SDPA is not known to memfit on {q.device.type}"
    if dropout_p > 0:
        return f"dropout_p={dropout_p} (CPU flash attention has no dropout)"
    if not (q.dim() == k.dim() == v.dim() == 4):
        return f"{q.dim()}-D inputs (CPU flash attention takes 4-D [B, H, L, D])"
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1]):
        return f"head dims q {q.shape[-1]}, k {k.shape[-1]}, v {v.shape[-1]} differ"
    if q.dtype not in _CPU_FLASH_DTYPES or not (q.dtype == k.dtype == v.dtype):
        return f"dtypes q {q.dtype}, k {k.dtype}, v {v.dtype}"
    if k.shape[:2] != v.shape[:2] or q.shape[0] != k.shape[0]:
        return f"batch dims q {tuple(q.shape[:2])}, k {tuple(k.shape[:2])}, v {tuple(v.shape[:2])}"
    if q.shape[1] != k.shape[1] and not (enable_gqa and q.shape[1] % k.shape[1] == 0):
        return f"{q.shape[1]} query heads against {k.shape[1]} key heads"
    if min(q.shape[-2], k.shape[-2]) == 0:
        return "an empty sequence"
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        return "a last dimension that is not contiguous"
    if attn_mask is not None:
        if attn_mask.requires_grad:
            return "the mask requires grad (CPU flash attention gives masks no gradient)"
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            return f"a {attn_mask.dtype} mask"
        try:
            torch.broadcast_shapes(attn_mask.shape, (*q.shape[:-1], k.shape[-2]))
        except RuntimeError:
            return f"a mask of shape {tuple(attn_mask.shape)}"
    return None


def fused_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` allowed only its fused backends: never the math path."""
    with sdpa_kernel(FUSED_BACKENDS):
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )


def _as_autocast_runs_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The inputs as SDPA sees them under autocast: floating ones in autocast's lower precision.

    SDPA is on autocast's lower-precision list (CPU and CUDA), so under ``torch.autocast`` it
    casts its inputs itself; memfit's chunked kernel is not an op autocast knows, and a model's
    q and k after fp32 rotary embeddings met its bf16 v (HF Llama under accelerate's
    ``mixed_precision="bf16"``: "q, k and v need one dtype")."""
    device = q.device.type
    if not torch.is_autocast_enabled(device):
        return q, k, v, attn_mask
    dtype = torch.get_autocast_dtype(device)

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    mask = attn_mask if attn_mask is None else cast(attn_mask)
    return cast(q), cast(k), cast(v), mask


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Scaled dot-product attention with SDPA's semantics, never storing an Lq x Lk tensor.

    ``q`` [..., Lq, D], ``k`` [..., Lk, D], ``v`` [..., Lk, Dv]; ``attn_mask`` bool (True = attend)
    or float (added to the scores), broadcastable to [..., Lq, Lk]; ``is_causal`` masks key j > i
    (top-left aligned, as SDPA); ``scale`` defaults to 1/sqrt(D). As with SDPA, dropout applies
    whenever ``dropout_p > 0`` (pass ``dropout_p=0.0`` in eval); its masks are the ones
    ``F.dropout`` would draw on the probabilities, so a model keeps plain PyTorch's RNG stream.
    A query whose boolean mask admits no key gets a zero output and no gradient, as with SDPA
    (naive softmax would give NaN), whichever kernel runs.
    """
    if is_causal and attn_mask is not None:
        raise ValueError(
            "give attn_mask or is_causal=True, not both (as F.scaled_dot_product_attention)"
        )
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    q, k, v, attn_mask = _as_autocast_runs_sdpa(q, k, v, attn_mask)
    if why_not_fused_sdpa(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa) is None:
        return fused_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if enable_gqa and q.shape[-3] != k.shape[-3]:
        groups = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(groups, dim=-3)
        v = v.repeat_interleave(groups, dim=-3)
    lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    q = q.expand(*lead, *q.shape[-2:])
    k = k.expand(*lead, *k.shape[-2:])
    v = v.expand(*lead, *v.shape[-2:])
    no_key: torch.Tensor | None = None
    kinds: list[str] = ["mul"]
    operands: list[torch.Tensor | None] = [None]
    values: list[float] = [1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)]
    if is_causal:
        lq, lk = q.shape[-2], k.shape[-2]
        future = torch.ones(lq, lk, dtype=torch.bool, device=q.device).triu(1)
        kinds.append("fill")
        operands.append(future)
        values.append(float("-inf"))
    elif attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            # finfo.min rather than -inf: a query with no key to attend stays finite in the kernel
            # (its output is zeroed below, as SDPA zeroes it); with -inf it would be NaN, and
            # backward's sums over queries would carry the NaN into every key's gradient.
            masked = attn_mask.logical_not()
            kinds.append("fill")
            operands.append(masked)
            values.append(torch.finfo(torch.float32).min)
            no_key = masked.all(-1, keepdim=True)
        else:
            kinds.append("add")
            operands.append(attn_mask)
            values.append(0.0)
    keep = None
    if dropout_p > 0:
        keep = attention_dropout_mask(
            [*lead, q.shape[-2], k.shape[-2]], dropout_p, q.device, dtype=q.dtype
        )
    out = chunked_attention(
        q, k, v, kinds, operands, values, dropout_p=dropout_p, dropout_mask=keep
    )
    return out if no_key is None else out.masked_fill(no_key, 0.0)
