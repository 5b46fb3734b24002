"""``memfit.nn.linear_cross_entropy`` equals ``F.cross_entropy(F.linear(...))`` and never holds
the ``[tokens, vocab]`` logits.

Loss and every gradient against plain PyTorch in float32, float64 and bfloat16, with and without
a bias, mean and sum, ignored tokens, chunks that do not divide the tokens; a frozen weight gets
no gradient computed; the ops' fake and autograd registrations pass ``torch.library.opcheck``;
and the measured peak of a step stays a few chunks above its inputs where plain PyTorch's holds
the logits several times over.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import memfit
from fake_kernels import assert_fake_matches_keyword_call
from memfit.nn.linear_cross_entropy import default_token_chunk, linear_cross_entropy, working_bytes

V, D = 50, 16


def _inputs(
    dtype: torch.dtype, bias: bool, shape: tuple[int, ...] = (3, 37)
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(*shape, D, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, D, generator=g) / 4).to(dtype).requires_grad_()
    b = torch.randn(V, generator=g).to(dtype).requires_grad_() if bias else None
    y = torch.randint(0, V, shape, generator=g)
    y.view(-1)[::5] = -100  # ignored tokens, in every chunk
    return h, w, b, y


def _grads(loss: torch.Tensor, *tensors: torch.Tensor | None) -> list[torch.Tensor]:
    present = [t for t in tensors if t is not None]
    return list(torch.autograd.grad(loss, present))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize(
    "dtype, logits_dtype, rtol",
    [
        (torch.float32, None, 1e-5),
        (torch.float64, None, 1e-12),
        # HF's logits.float(): bf16 logits, loss in fp32, as plain PyTorch computes it
        (torch.bfloat16, torch.float32, 2e-2),
    ],
    ids=["fp32", "fp64", "bf16"],
)
def test_matches_plain_pytorch(
    dtype: torch.dtype, logits_dtype: torch.dtype | None, rtol: float, bias: bool, reduction: str
) -> None:
    h, w, b, y = _inputs(dtype, bias)
    logits = F.linear(h, w, b)
    if logits_dtype is not None:
        logits = logits.to(logits_dtype)
    ref = F.cross_entropy(logits.view(-1, V), y.view(-1), reduction=reduction)
    ref_grads = _grads(ref, h, w, b)
    loss = linear_cross_entropy(h, w, y, b, reduction=reduction, chunk_size=7, dtype=logits_dtype)
    grads = _grads(loss, h, w, b)
    assert loss.dtype == ref.dtype
    assert torch.allclose(loss, ref, rtol=rtol, atol=0), (loss, ref)
    for name, g, r in zip("hwb", grads, ref_grads):
        assert g.dtype == r.dtype
        err = (g - r).abs().max() / r.abs().max()
        assert err <= rtol, f"d{name}: relative error {err:.3g}"


def test_every_chunk_size_gives_the_same_result() -> None:
    """One chunk, ragged chunks, one token a chunk, and the default: one loss, one gradient."""
    h, w, b, y = _inputs(torch.float64, True)
    results = []
    for chunk in (None, 1, 10, 111, 1000):
        loss = linear_cross_entropy(h, w, y, b, chunk_size=chunk)
        results.append((loss, *_grads(loss, h, w, b)))
    for other in results[1:]:
        for a, r in zip(other, results[0]):
            assert torch.allclose(a, r, rtol=1e-12, atol=1e-15)


def test_a_frozen_head_gets_no_weight_gradient() -> None:
    """A head that does not train (a LoRA model's): only the hidden states' gradient is made."""
    h, w, _, y = _inputs(torch.float32, False)
    w = w.detach()
    ref = _grads(F.cross_entropy(F.linear(h, w).view(-1, V), y.view(-1)), h)[0]
    linear_cross_entropy(h, w, y).backward()
    assert w.grad is None
    assert h.grad is not None and torch.allclose(h.grad, ref, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_no_counted_token_gives_what_plain_pytorch_gives(reduction: str) -> None:
    h, w, b, y = _inputs(torch.float32, True)
    y = torch.full_like(y, 7)
    ref = F.cross_entropy(F.linear(h, w, b).view(-1, V), y.view(-1), ignore_index=7)
    loss = linear_cross_entropy(h, w, y, b, ignore_index=7, reduction=reduction)
    if reduction == "mean":
        assert ref.isnan() and loss.isnan()
    else:
        assert loss.item() == 0.0
        assert all(g.abs().max() == 0 for g in _grads(loss, h, w, b))


@pytest.mark.slow
def test_opcheck() -> None:
    """The fake (meta) functions give the real ops' sizes and the autograd registration holds,
    as AOTAutograd needs."""
    h, w, b, y = _inputs(torch.float32, True, (20,))
    args = (h, w, b, y, -100, "mean", 6)
    torch.library.opcheck(torch.ops.memfit.linear_cross_entropy_fwd, args)
    loss, lse = torch.ops.memfit.linear_cross_entropy_fwd(*args)
    bwd = (torch.ones(()), h.detach(), w.detach(), b.detach(), y, lse, -100, "mean", 6)
    torch.library.opcheck(torch.ops.memfit.linear_cross_entropy_bwd, (*bwd, [True, False, True]))


def test_default_chunk_literal() -> None:
    # logits chunk of max(h's bytes, 1 MiB): 1 MiB / (2048 * 4 B) = 128 tokens
    assert default_token_chunk(1024, 128, 2048) == 128
    # h (64 MiB) larger than the floor: a chunk of logits the size of h
    assert default_token_chunk(32768, 512, 4096) == 4096
    # Llama 3's vocabulary: one token of logits is half a MiB; h is 64 MiB
    assert default_token_chunk(4096, 4096, 128256) == 130
    assert default_token_chunk(16, 64, 128256) == 2  # the 1 MiB floor
    assert default_token_chunk(10, 16, 50) == 10  # never more than the tokens
    assert default_token_chunk(10, 16, 10**9) == 1


@pytest.mark.slow
def test_peak_holds_no_logits() -> None:
    """Tokens 2048, vocab 2048, hidden 64: plain PyTorch's step holds the 16 MiB logits several
    times; the kernel's stays within its inputs, gradients and a few 1 MiB chunks."""
    g = torch.Generator().manual_seed(0)
    n, vocab, hidden = 2048, 2048, 64
    h = torch.randn(n, hidden, generator=g, requires_grad=True)
    w = (torch.randn(vocab, hidden, generator=g) / 8).requires_grad_()
    y = torch.randint(0, vocab, (n,), generator=g)

    def plain() -> None:
        F.cross_entropy(F.linear(h, w), y).backward()

    def fused() -> None:
        linear_cross_entropy(h, w, y).backward()

    logits = n * vocab * 4
    h.grad = w.grad = None
    plain_peak = memfit.measure(plain).peak_bytes
    h.grad = w.grad = None
    fused_peak = memfit.measure(fused).peak_bytes
    assert plain_peak is not None and fused_peak is not None
    assert plain_peak >= 2 * logits
    grads = h.numel() * 4 + w.numel() * 4
    assert fused_peak <= grads + 3 * (1 << 20), fused_peak


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(target=torch.zeros(3, 36, dtype=torch.long)), "token dims"),
        (dict(target=torch.zeros(3, 37)), "class indices"),
        (dict(reduction="none"), "reduction"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(bias=torch.zeros(V + 1)), "bias"),
        (dict(weight=torch.zeros(V, D, dtype=torch.float64)), "one dtype"),
    ],
)
def test_errors_name_the_value_and_the_rule(kwargs: dict, message: str) -> None:
    h, w, _, y = _inputs(torch.float32, False)
    args = dict(hidden=h, weight=w, target=y) | kwargs
    with pytest.raises(ValueError, match=message):
        linear_cross_entropy(**args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "hidden", "vocab", "bias"), [(256, 128, 2048, False), (300, 64, 2048, True)]
)
def test_working_bytes_cover_what_the_kernel_allocates(
    dtype: torch.dtype, tokens: int, hidden: int, vocab: int, bias: bool
) -> None:
    """What a plan on fake tensors counts for the kernel (it cannot run it) is at least what the
    running kernel allocates beyond its outputs, and close: within 16 KiB in float32, within 15%
    in bf16 (where CPU matmuls add oneDNN's own scratch)."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g).to(dtype)
    w = torch.randn(vocab, hidden, generator=g).to(dtype)
    b = torch.randn(vocab, generator=g).to(dtype) if bias else None
    t = torch.randint(0, vocab, (tokens,), generator=g)
    t[::7] = -100
    ops = torch.ops.memfit

    def fwd() -> tuple[torch.Tensor, torch.Tensor]:
        return ops.linear_cross_entropy_fwd(h, w, b, t, -100, "mean", 0)

    loss, lse = fwd()
    grad = torch.ones((), dtype=loss.dtype)

    def bwd() -> list[torch.Tensor]:
        needs = [True, True, bias]
        return ops.linear_cross_entropy_bwd(grad, h, w, b, t, lse, -100, "mean", 0, needs)

    def beyond_outputs(fn: Any) -> int:
        peak = memfit.measure(fn).peak_bytes or 0
        out = fn()
        return peak - sum(o.untyped_storage().nbytes() for o in out)

    for backward, fn in ((False, fwd), (True, bwd)):
        measured = beyond_outputs(fn)
        rule = working_bytes(tokens, hidden, vocab, dtype, backward=backward, bias=bias)
        assert measured <= rule, (backward, measured, rule)
        slack = 16 * 1024 if dtype == torch.float32 else 0.15 * measured
        assert rule <= measured + slack, (backward, measured, rule)


def test_fakes_see_the_arguments_of_a_keyword_call() -> None:
    h, w, b, y = (t.detach() for t in _inputs(torch.float32, True, (20,)))
    fwd = (h, w, b, y, -100, "mean", 6)
    assert_fake_matches_keyword_call(torch.ops.memfit.linear_cross_entropy_fwd, fwd)
    _, lse = torch.ops.memfit.linear_cross_entropy_fwd(*fwd)
    for needs in ([True, True, True], [False, True, False]):
        bwd = (torch.ones(()), h, w, b, y, lse, -100, "mean", 6, needs)
        assert_fake_matches_keyword_call(torch.ops.memfit.linear_cross_entropy_bwd, bwd)
