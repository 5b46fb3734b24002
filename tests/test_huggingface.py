"""attn_implementation="memfit" trains HuggingFace models as their eager attention does."""

from __future__ import annotations

import warnings

import pytest
import torch

from hf_models import tiny_hf
from memfit.nn.huggingface import register_huggingface

pytest.importorskip("transformers")


def _llama(impl: str) -> torch.nn.Module:
    return tiny_hf("llama", impl)


def _bert(impl: str) -> torch.nn.Module:
    return tiny_hf("bert", impl)


def _step(
    model: torch.nn.Module, **inputs: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(11)
    out = model(**inputs)
    out = out.logits if hasattr(out, "logits") else out.last_hidden_state
    weights = torch.randn(out.shape[-1], generator=torch.Generator().manual_seed(1))
    (out * weights).sum().backward()
    return out.detach(), [p.grad for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("make", [_llama, _bert], ids=["llama", "bert-dropout"])
def test_memfit_attention_trains_like_eager(make) -> None:  # type: ignore[no-untyped-def]
    assert register_huggingface()
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 12:] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_out, ref_grads = _step(make("eager").train(), input_ids=ids, attention_mask=mask)
        out, grads = _step(make("memfit").train(), input_ids=ids, attention_mask=mask)
    assert (out - ref_out).abs().max() <= 1e-5 * ref_out.abs().max()
    scale = max(r.abs().max() for r in ref_grads)
    for g, r in zip(grads, ref_grads, strict=True):
        assert (g - r).abs().max() <= 1e-4 * scale


def test_output_attentions_is_refused_with_the_way_out() -> None:
    register_huggingface()
    model = _llama("memfit")
    ids = torch.randint(0, 100, (1, 8))
    with pytest.raises(ValueError, match="attn_implementation='eager'"):
        model(input_ids=ids, output_attentions=True)
