"""The attention pass finds attention however a model writes it, and changes nothing else.

Every realistic variant (``memfit.bench.attention_layers``) is found and rewritten to the kernel
expected on CPU; outputs and gradients match plain PyTorch to fp32 tolerance, with dropout (the
masks are eager's, so the same seed gives the same result); a site whose probabilities are also
returned is left alone and reported; HuggingFace models with eager attention are matched; and the
quadratic tensors are really gone from what the step keeps.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import memfit
from hf_models import tiny_hf
from memfit.bench.attention_layers import VARIANTS, AdditiveDecoder, AttentionVariant, SelfAttention
from memfit.capture.attention import ADDITIVE, MEMFIT, SDPA

B, T, D = 2, 24, 32


def _inputs(variant: AttentionVariant) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, D, generator=g)
    if not variant.needs_padding:
        return (x,)
    pad = torch.ones(B, T, dtype=torch.bool)
    pad[1, T - 7 :] = False
    return (x, pad)


def _step(
    model: nn.Module, inputs: tuple[torch.Tensor, ...], seed: int = 7
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    out = model(*inputs)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    grads = [
        p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()
    ]
    return out.detach(), grads, torch.get_rng_state()


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float) -> bool:
    return bool((a - b).abs().max() <= rtol * b.abs().max().clamp_min(1e-12))


def _grads_close(grads: list[torch.Tensor], ref: list[torch.Tensor], rtol: float) -> None:
    """Each gradient within ``rtol`` of the largest reference gradient entry.

    Relative to the largest entry rather than per tensor: some gradients are zero in exact
    arithmetic (a key bias under softmax) and only rounding noise in both runs.
    """
    scale = max(r.abs().max() for r in ref)
    for i, (g, r) in enumerate(zip(grads, ref, strict=True)):
        err = (g - r).abs().max()
        assert err <= rtol * scale, f"gradient {i}: error {err:.3g}, largest gradient {scale:.3g}"


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_each_variant_is_found_and_matches_plain_pytorch(variant: AttentionVariant) -> None:
    torch.manual_seed(0)
    model = variant.make()
    inputs = _inputs(variant)
    ref_out, ref_grads, ref_rng = _step(model, inputs)
    wrapped = memfit.checkpoint(model, "none")
    out, grads, rng = _step(wrapped, inputs)
    (site,) = wrapped.memfit.plan.attention
    assert site.kernel == variant.expected_kernel, site
    assert site.scores_shape[-2:] == (T, T)
    assert "attention_layers.py:" in site.where
    assert _close(out, ref_out, 1e-5), (out - ref_out).abs().max()
    _grads_close(grads, ref_grads, 1e-4)
    assert torch.equal(rng, ref_rng), "the step drew a different amount of randomness than eager"


def test_a_rewritten_attention_serves_every_sequence_length() -> None:
    """Lengths that vary are captured once more with the length as a symbol: the rewritten
    graph (a causal mask sliced to the length, dropout masks of the scores' shape read from q
    and k) holds at every length, each step as plain PyTorch's, its RNG stream included."""
    variant = next(v for v in VARIANTS if v.name == "causal_masked_fill_dropout")
    torch.manual_seed(0)
    model = variant.make()
    plain = copy.deepcopy(model)
    wrapped = memfit.checkpoint(model, "none")
    g = torch.Generator().manual_seed(0)
    for length in (T, 40, 33, 17):
        x = torch.randn(B, length, D, generator=g)
        ref_out, ref_grads, ref_rng = _step(plain, (x,))
        out, grads, rng = _step(wrapped, (x,))
        (site,) = wrapped.memfit.plan.attention
        assert site.kernel == MEMFIT
        assert _close(out, ref_out, 1e-5)
        _grads_close(grads, ref_grads, 1e-4)
        assert torch.equal(rng, ref_rng)
    assert wrapped.memfit._planned.shapes_planned == 2


def test_attention_off_leaves_the_graph_as_written() -> None:
    variant = VARIANTS[0]
    torch.manual_seed(0)
    model = variant.make()
    inputs = _inputs(variant)
    ref_out, ref_grads, _ = _step(model, inputs)
    wrapped = memfit.checkpoint(model, "none", options=memfit.Options(attention="off"))
    out, grads, _ = _step(wrapped, inputs)
    assert wrapped.memfit.plan.attention == ()
    assert torch.equal(out, ref_out)
    assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads, strict=True))


def test_probabilities_read_elsewhere_are_left_alone_and_reported() -> None:
    model = SelfAttention("causal_masked_fill", return_probs=True)

    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y, probs = self.attn(x)
            return y + probs.mean()

    wrapped = memfit.checkpoint(Both(), "none")
    _step(wrapped, (torch.randn(B, T, D),))
    (site,) = wrapped.memfit.plan.attention
    assert site.kernel is None
    assert "probabilities" in site.reason and "attn" in site.where


def test_bad_attention_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="attention must be one of"):
        memfit.checkpoint(SelfAttention("fused_qkv"), options=memfit.Options(attention="flash"))


def test_the_quadratic_tensors_are_no_longer_kept() -> None:
    """At T=256 the [B,H,T,T] probabilities dominate what "none" keeps; the pass removes them."""
    torch.manual_seed(0)
    model = SelfAttention("causal_masked_fill", dropout=0.1)
    x = torch.randn(1, 256, D)
    kept = {}
    for mode in ("off", "auto"):
        wrapped = memfit.checkpoint(model, "none", options=memfit.Options(attention=mode))
        _step(wrapped, (x,))
        kept[mode] = wrapped.memfit.plan.kept_bytes
    scores_bytes = 1 * 4 * 256 * 256 * 4
    assert kept["off"] > 2 * scores_bytes  # naive keeps probabilities and the dropout output
    # what is left: the layer's inputs and outputs, q, k, v, logsumexp and a packed mask
    assert kept["auto"] < scores_bytes / 2


def _hf(name: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    model = tiny_hf(name)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    if name == "bert":
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[1, 11:] = 0
        return model, {"input_ids": ids, "attention_mask": mask}
    return model, {"input_ids": ids}


@pytest.mark.parametrize("name,kernel", [("bert", MEMFIT), ("gpt2", MEMFIT), ("llama", SDPA)])
def test_huggingface_eager_attention_is_matched(name: str, kernel: str) -> None:
    torch.manual_seed(0)
    model, inputs = _hf(name)
    model.train()

    def loss(m: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
        torch.manual_seed(3)
        model.zero_grad(set_to_none=True)
        out = m(**inputs).last_hidden_state if name == "bert" else m(**inputs).logits
        weights = torch.randn(out.shape[-1], generator=torch.Generator().manual_seed(1))
        (out.float() * weights).sum().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    ref_out, ref_grads = loss(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = memfit.checkpoint(model, "none")
        out, grads = loss(wrapped)
    sites = wrapped.memfit.plan.attention
    assert [s.kernel for s in sites] == [kernel], sites
    assert _close(out, ref_out, 1e-5)
    _grads_close(grads, ref_grads, 1e-4)


def test_huggingface_output_attentions_is_left_alone() -> None:
    torch.manual_seed(0)
    model, inputs = _hf("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = memfit.checkpoint(model, "none")
        out = wrapped(**inputs, output_attentions=True)
        out.logits.sum().backward()
    (site,) = wrapped.memfit.plan.attention
    assert site.kernel is None and "probabilities" in site.reason


def _additive_inputs(steps: int, keys: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    pad = torch.ones(2, keys, dtype=torch.bool)
    pad[1, keys - 3 :] = False
    return torch.randn(2, steps, 16, generator=g), torch.randn(2, keys, 16, generator=g), pad


@pytest.mark.parametrize("all_steps", [False, True], ids=["per-step", "all-queries"])
def test_additive_attention_is_found_and_matches_plain_pytorch(all_steps: bool) -> None:
    torch.manual_seed(0)
    model = AdditiveDecoder(all_steps=all_steps)
    inputs = _additive_inputs(steps=4, keys=9)
    ref_out, ref_grads, _ = _step(model, inputs)
    wrapped = memfit.checkpoint(model, "none")
    out, grads, _ = _step(wrapped, inputs)
    sites = wrapped.memfit.plan.attention
    assert [s.kernel for s in sites] == [ADDITIVE] * (1 if all_steps else 4), sites
    assert _close(out, ref_out, 1e-5)
    _grads_close(grads, ref_grads, 1e-4)


@pytest.mark.slow
def test_additive_decoder_keeps_no_tanh_per_step() -> None:
    """Naive keeps a [B, Tk, H] tanh per decoder step; after the pass no step keeps one."""
    torch.manual_seed(0)
    model = AdditiveDecoder()
    inputs = _additive_inputs(steps=8, keys=64)
    kept = {}
    for mode in ("off", "auto"):
        wrapped = memfit.checkpoint(model, "none", options=memfit.Options(attention=mode))
        _step(wrapped, inputs)
        kept[mode] = wrapped.memfit.plan.kept_bytes
    tanh_per_step = 2 * 64 * 32 * 4
    assert kept["off"] - kept["auto"] >= 7 * tanh_per_step  # all steps but the last, at least


class _ThreeDimSdpa(nn.Module):
    """SDPA on 3-D inputs, which takes its math path: memfit's kernel replaces the call."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        p = self.dropout if self.training else 0.0
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p)


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_an_sdpa_call_on_its_math_path_is_rewritten_and_trains(dropout: float) -> None:
    """The rewrite passes SDPA's arguments to memfit's kernel under the kernel's own names (it
    passed query=/key=/value= and every such call failed to compile)."""
    torch.manual_seed(0)
    model = _ThreeDimSdpa(dropout)
    plain = copy.deepcopy(model)
    (x,) = _inputs(VARIANTS[0])
    wrapped = memfit.checkpoint(model, "none")
    out, grads, _ = _step(wrapped, (x,))
    assert [s.kernel for s in wrapped.memfit.plan.attention] == [MEMFIT]
    assert all(torch.isfinite(g).all() for g in grads)
    if dropout == 0.0:
        ref_out, ref_grads, _ = _step(plain, (x,))
        assert _close(out, ref_out, 1e-5)
        _grads_close(grads, ref_grads, 1e-4)


class _GroupedQuery(nn.Module):
    """Grouped-query attention written as HF's ``repeat_kv`` writes it (8 query heads, 2
    key/value heads), with a causal mask passed to SDPA: the form HF's decoders take under
    Dynamo, where their padding mask cannot be skipped."""

    def __init__(self, unsqueeze: bool) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D // 4), nn.Linear(D, D // 4)
        self.unsqueeze = unsqueeze

    def _repeat(self, x: torch.Tensor) -> torch.Tensor:
        b, h, length, d = x.shape
        wide = x.unsqueeze(2) if self.unsqueeze else x[:, :, None, :, :]
        return wide.expand(b, h, 4, length, d).reshape(b, h * 4, length, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, length, _ = x.shape
        q = self.q(x).view(b, length, 8, D // 8).transpose(1, 2)
        k = self.k(x).view(b, length, 2, D // 8).transpose(1, 2)
        v = self.v(x).view(b, length, 2, D // 8).transpose(1, 2)
        mask = torch.ones(length, length, dtype=torch.bool).tril().expand(b, 1, length, length)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, self._repeat(k), self._repeat(v), attn_mask=mask
        )
        return out.transpose(1, 2).reshape(b, length, D)


@pytest.mark.parametrize("unsqueeze", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_repeated_key_value_heads_reach_sdpa_unrepeated(unsqueeze: bool) -> None:
    """SDPA on keys and values whose heads the model repeated gets them unrepeated with
    ``enable_gqa=True`` (``capture.attention.gqa``): the same attention, and the step no longer
    keeps the repeated copies for SDPA's backward."""
    torch.manual_seed(0)
    model = _GroupedQuery(unsqueeze)
    plain = copy.deepcopy(model)
    (x,) = _inputs(VARIANTS[0])
    wrapped = memfit.checkpoint(model, "none")
    out, grads, _ = _step(wrapped, (x,))
    (site,) = wrapped.memfit.plan.attention
    assert site.kernel == SDPA and "enable_gqa" in site.reason
    ref_out, ref_grads, _ = _step(plain, (x,))
    assert _close(out, ref_out, 1e-5)
    _grads_close(grads, ref_grads, 1e-5)
    off = memfit.checkpoint(copy.deepcopy(plain), "none", options=memfit.Options(attention="off"))
    _step(off, (x,))
    assert wrapped.memfit.plan.kept_bytes < off.memfit.plan.kept_bytes
