"""memfit.nn.attention has SDPA's semantics and never takes an O(L^2) path.

The CPU predicate ``why_not_fused_sdpa`` is checked against torch itself (SDPA forced to its
flash kernel raises exactly when the predicate says it cannot run); outputs and gradients match
naive attention written out here, including dropout under the same seed; and a dropout step,
where SDPA stores the L x L probabilities, peaks far below one such tensor.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import memfit
from memfit.nn.attention import attention, why_not_fused_sdpa


def _naive(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):  # type: ignore[no-untyped-def]
    if enable_gqa:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    s = (q @ k.transpose(-2, -1)) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    elif attn_mask is not None:
        s = (
            s.masked_fill(~attn_mask, float("-inf"))
            if attn_mask.dtype == torch.bool
            else s + attn_mask
        )
    return F.dropout(s.softmax(-1), dropout_p, training=True) @ v


def _t(*shape: int, grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape).requires_grad_(grad)


CASES = {
    "plain": lambda: ((_t(2, 4, 24, 8), _t(2, 4, 24, 8), _t(2, 4, 24, 8)), {}),
    "causal": lambda: ((_t(2, 4, 24, 8), _t(2, 4, 24, 8), _t(2, 4, 24, 8)), {"is_causal": True}),
    "bool mask": lambda: (
        (_t(2, 4, 24, 8), _t(2, 4, 24, 8), _t(2, 4, 24, 8)),
        {"attn_mask": torch.rand(2, 1, 24, 24) > 0.3},
    ),
    "float mask, scale": lambda: (
        (_t(2, 4, 24, 8), _t(2, 4, 30, 8), _t(2, 4, 30, 8)),
        {"attn_mask": torch.randn(2, 1, 1, 30), "scale": 0.2},
    ),
    "3-D": lambda: ((_t(6, 24, 8), _t(6, 24, 8), _t(6, 24, 8)), {}),
    "value dim": lambda: ((_t(2, 4, 24, 8), _t(2, 4, 24, 8), _t(2, 4, 24, 16)), {}),
    "mask requires grad": lambda: (
        (_t(2, 4, 24, 8), _t(2, 4, 24, 8), _t(2, 4, 24, 8)),
        {"attn_mask": _t(1, 4, 24, 24)},
    ),
    "gqa": lambda: ((_t(2, 4, 24, 8), _t(2, 2, 24, 8), _t(2, 2, 24, 8)), {"enable_gqa": True}),
    "dropout": lambda: ((_t(2, 4, 24, 8), _t(2, 4, 24, 8), _t(2, 4, 24, 8)), {"dropout_p": 0.2}),
    "causal dropout 3-D": lambda: (
        (_t(6, 24, 8), _t(6, 24, 8), _t(6, 24, 8)),
        {"dropout_p": 0.1, "is_causal": True},
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_the_cpu_predicate_agrees_with_torch(case: str) -> None:
    (q, k, v), kw = CASES[case]()
    why = why_not_fused_sdpa(
        q,
        k,
        v,
        kw.get("attn_mask"),
        kw.get("dropout_p", 0.0),
        kw.get("is_causal", False),
        kw.get("enable_gqa", False),
    )
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            F.scaled_dot_product_attention(q, k, v, **kw).sum().backward()
        ran = True
    except RuntimeError:
        ran = False
    assert ran == (why is None), why


@pytest.mark.parametrize("case", CASES)
def test_matches_naive_attention(case: str) -> None:
    (q, k, v), kw = CASES[case]()
    leaves = [t for t in (q, k, v, kw.get("attn_mask")) if t is not None and t.requires_grad]
    grad = torch.randn(*q.shape[:-1], v.shape[-1])
    torch.manual_seed(5)
    ref = _naive(q, k, v, **kw)
    ref_grads = torch.autograd.grad(ref, leaves, grad)
    ref_rng = torch.get_rng_state()
    torch.manual_seed(5)
    out = attention(q, k, v, **kw)
    grads = torch.autograd.grad(out, leaves, grad)
    assert torch.equal(torch.get_rng_state(), ref_rng)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()
    for g, r in zip(grads, ref_grads, strict=True):
        assert (g - r).abs().max() <= 1e-4 * r.abs().max()


def test_dropout_step_keeps_no_quadratic_tensor() -> None:
    q, k, v = (_t(1, 2, 2048, 32) for _ in range(3))
    one_scores = 2 * 2048 * 2048 * 4
    peaks = {}
    for name, fn in (("memfit", attention), ("sdpa", F.scaled_dot_product_attention)):
        m = memfit.measure(lambda fn=fn: fn(q, k, v, dropout_p=0.1).sum().backward())
        assert m.peak_bytes is not None
        peaks[name] = m.peak_bytes
    assert peaks["sdpa"] > one_scores  # the math path SDPA silently takes
    assert peaks["memfit"] < one_scores / 4


@pytest.mark.parametrize("dropout_p", [0.0, 0.2], ids=["fused", "chunked"])
def test_a_query_with_no_key_gets_zeros_as_with_sdpa(dropout_p: float) -> None:
    """Left-padded batches mask every key of some queries: SDPA gives 0 there, never NaN."""
    q, k, v = (_t(2, 2, 12, 8) for _ in range(3))
    mask = torch.ones(2, 1, 12, 12, dtype=torch.bool).tril()
    mask[1, :, :3] = False  # the first three queries of the second sequence see nothing
    out = attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    assert torch.equal(out[1, :, :3], torch.zeros_like(out[1, :, :3]))
    assert all(torch.isfinite(g).all() for g in grads)
    if dropout_p == 0:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
        assert torch.allclose(out, ref)
        assert all(torch.allclose(g, r, atol=1e-6) for g, r in zip(grads, ref_grads, strict=True))
    else:  # the rows that see keys equal naive attention with the same dropout masks
        torch.manual_seed(4)
        out = attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        torch.manual_seed(4)
        ref = _naive(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        assert torch.allclose(out[0], ref[0], atol=1e-6)
        assert torch.allclose(out[1, :, 3:], ref[1, :, 3:], atol=1e-6)


def test_bad_arguments_are_refused() -> None:
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="dropout_p"):
        attention(q, q, q, dropout_p=1.0)
    with pytest.raises(ValueError, match="not both"):
        attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool), is_causal=True)


def test_under_autocast_the_inputs_are_cast_as_sdpa_casts_them() -> None:
    """SDPA is on autocast's lower-precision list; memfit's kernel is not an op autocast knows, so
    it casts as SDPA would (fp32 q and k after rotary embeddings met a bf16 v: it raised)."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 2, 16, 8, generator=g), torch.randn(2, 2, 16, 8, generator=g)
    v = torch.randn(2, 2, 16, 8, generator=g).bfloat16()
    bias = torch.randn(16, 16, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        for mask in (bias, bias.requires_grad_()):  # the second takes the chunked kernel
            got = attention(q, k, v, attn_mask=mask)
            assert got.dtype == expected.dtype == torch.bfloat16
            torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
