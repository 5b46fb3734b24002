"""attn_implementation="memfit" trains HuggingFace models as their eager attention does, and is
registered whatever the import order of memfit and transformers."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from clitools import cli_env
from hf_models import tiny_hf
from memfit.nn.huggingface import _RegisterOnImport, register_huggingface

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


# Each order runs in a fresh process: in this one transformers is loaded already. The GPT-2 is
# then built the three ways transformers checks the name: from_config, its config's
# _attn_implementation, set_attn_implementation.
_IMPORTS = {
    "memfit-first": """
import sys
import memfit
assert "transformers" not in sys.modules, "import memfit imported transformers"
import transformers
""",
    "transformers-first": """
import sys
import transformers
import memfit
""",
}
_TINY_GPT2 = """
import torch
import memfit.nn.huggingface as hf
calls = []
attention = hf.attention
hf.attention = lambda *args, **kwargs: calls.append(1) or attention(*args, **kwargs)
config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="memfit")
assert model.config._attn_implementation == "memfit", model.config._attn_implementation
assert model(torch.randint(0, 64, (1, 8))).logits.shape == (1, 8, 64)
assert calls, "the forward did not run memfit's attention"
config._attn_implementation = "memfit"
assert transformers.GPT2LMHeadModel(config).config._attn_implementation == "memfit"
model.set_attn_implementation("eager")
model.set_attn_implementation("memfit")
assert model.config._attn_implementation == "memfit"
assert not any(type(f).__module__ == hf.__name__ for f in sys.meta_path), sys.meta_path
assert type(transformers.modeling_utils.__loader__).__name__ == "SourceFileLoader"
"""


@pytest.mark.parametrize("order", list(_IMPORTS))
def test_attn_implementation_memfit_whatever_the_import_order(order: str) -> None:
    """memfit first must also leave transformers unimported: it costs seconds."""
    done = subprocess.run(
        [sys.executable, "-c", _IMPORTS[order] + _TINY_GPT2],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_failed_registration_warns_and_never_breaks_the_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "memfit_hook_probe.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []

    def register(module):  # type: ignore[no-untyped-def]
        seen.append(module.VALUE)
        raise RuntimeError("registry moved")

    hook = _RegisterOnImport({"memfit_hook_probe": register})
    monkeypatch.setattr(sys, "meta_path", [hook, *sys.meta_path])
    monkeypatch.delitem(sys.modules, "memfit_hook_probe", raising=False)
    with pytest.warns(RuntimeWarning, match=r"registry moved.*register_huggingface\(\)"):
        import memfit_hook_probe  # type: ignore[import-not-found]
    assert memfit_hook_probe.VALUE == 1 and seen == [1]
    assert hook not in sys.meta_path
    assert type(memfit_hook_probe.__loader__).__name__ == "SourceFileLoader"
    monkeypatch.delitem(sys.modules, "memfit_hook_probe")


def test_an_encoder_decoder_trains_without_its_cache_as_under_hf_checkpointing() -> None:
    """T5's cache holds every decoder layer's cross-attention keys and values, alive at the end
    of the forward and never read by a training step: memfit's training calls pass
    ``use_cache=False``, as ``gradient_checkpointing_enable()`` does. Not in evaluation, and not
    for a decoder-only model, whose cache is what its backward keeps anyway."""
    transformers = pytest.importorskip("transformers")
    import copy

    import memfit

    torch.manual_seed(0)
    config = transformers.T5Config(
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=4,
        vocab_size=100,
        decoder_start_token_id=0,
        pad_token_id=0,
        dropout_rate=0.0,  # the losses compared draw nothing
    )
    plain = transformers.T5ForConditionalGeneration(config)
    t5 = memfit.checkpoint(copy.deepcopy(plain), "memory")
    ids = torch.randint(1, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    labels = ids[:, :4].contiguous()
    out = t5(input_ids=ids, labels=labels)
    assert out.past_key_values is None
    expected = plain(input_ids=ids, labels=labels).loss
    # the loss head runs memfit.nn.linear_cross_entropy: plain's loss to fp tolerance
    torch.testing.assert_close(out.loss, expected, rtol=1e-6, atol=0)
    with torch.no_grad():
        assert t5(input_ids=ids, labels=labels).past_key_values is not None
    gpt2 = memfit.checkpoint(tiny_hf("gpt2"), "memory")
    assert gpt2(input_ids=ids, labels=ids).past_key_values is not None
