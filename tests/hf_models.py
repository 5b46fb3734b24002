"""Tiny HuggingFace models (one layer, width 32, vocabulary 100) for the attention tests.

One place for them, so the capture pass and the ``attn_implementation="memfit"`` tests train
the same models. Weights are drawn under seed 0.
"""

from __future__ import annotations

import pytest
import torch


def tiny_hf(name: str, attn_implementation: str = "eager") -> torch.nn.Module:
    """``"bert"`` (BertModel, no pooler), ``"gpt2"`` (GPT2LMHeadModel) or ``"llama"``
    (LlamaForCausalLM, grouped-query attention: 4 query heads, 2 key/value heads)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    small = dict(
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=100,
        attn_implementation=attn_implementation,
    )
    if name == "bert":
        config = transformers.BertConfig(hidden_size=32, max_position_embeddings=64, **small)
        return transformers.BertModel(config, add_pooling_layer=False)
    if name == "gpt2":
        config = transformers.GPT2Config(
            n_embd=32,
            n_layer=1,
            n_head=4,
            vocab_size=100,
            n_positions=64,
            attn_implementation=attn_implementation,
        )
        return transformers.GPT2LMHeadModel(config)
    if name == "llama":
        config = transformers.LlamaConfig(hidden_size=32, num_key_value_heads=2, **small)
        return transformers.LlamaForCausalLM(config)
    raise ValueError(f"no tiny HuggingFace model named {name!r}")
