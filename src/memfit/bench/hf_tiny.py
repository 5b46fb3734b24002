"""Tiny random HuggingFace models of every kind transformers ships, built from configs alone.

Why: memfit rewrites whatever graph a model's forward and backward make, and transformers'
architectures differ in exactly what that rewrite meets (rotary and ALiBi positions, grouped
and multi-latent attention, routed experts, selective scans, convolutions, cross-attention,
CTC's log-softmax over time). The sweep (:mod:`memfit.bench.hf_sweep`) trains each of them,
so this module turns one architecture name into a small model with a loss and a batch with
labels, without any download.

How: the architecture's ``*Config`` is built with its defaults, every size it has that
:data:`SMALL` names is shrunk (only the fields the config itself has, so names another config
maps onto them are never passed twice), and :data:`OVERRIDES` adds what one architecture needs
beyond that (sub-configs, lists of per-stage sizes, sizes that must divide each other). The
model class is the one transformers' auto mappings give the task (``*ForCausalLM``,
``*ForMaskedLM``, ``*ForConditionalGeneration``, ``*ForImageClassification``, ``*ForCTC``,
...), so its forward computes the loss from ``labels`` as ``Trainer`` expects. Weights and
inputs are drawn under seed 0. transformers is imported when a model is built, not before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "OVERRIDES",
    "SMALL",
    "build",
    "make_inputs",
    "tiny_config",
]

#: The vocabulary every tiny text model gets; token ids drawn from [3, VOCAB) leave 0, 1 and 2
#: to padding, start and end.
VOCAB = 99

#: Sizes shrunk in every config that has the field (by its own name: a config's ``attribute_map``
#: aliases are never passed, so no value is given twice).
SMALL: dict[str, Any] = {
    # widths, depths, heads
    "hidden_size": 32,
    "d_model": 32,
    "n_embd": 32,
    "embed_dim": 32,
    "embedding_size": 32,
    "word_embed_proj_dim": 32,
    "num_hidden_layers": 2,
    "num_layers": 2,
    "n_layer": 2,
    "num_decoder_layers": 2,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "num_attention_heads": 4,
    "num_heads": 4,
    "n_head": 4,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "d_kv": 8,
    "intermediate_size": 64,
    "d_ff": 64,
    "n_inner": 64,
    "ffn_dim": 64,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    # vocabularies and positions (64 tokens a row, with room for offsets)
    "vocab_size": VOCAB,
    "max_position_embeddings": 128,
    "n_positions": 128,
    "n_ctx": 128,
    "max_source_positions": 128,
    "max_target_positions": 128,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "decoder_start_token_id": 1,
    # routed experts
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "n_group": 1,
    "topk_group": 1,
    # multi-latent attention
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    # images: 32 x 32 in 4 x 4 patches, 64 tokens as the text rows have
    "image_size": 32,
    "patch_size": 4,
}

#: Per-architecture fields beyond :data:`SMALL` (applied after it).
OVERRIDES: dict[str, dict[str, Any]] = {
    "albert": {"num_hidden_groups": 1},
    "distilbert": {"dim": 32, "hidden_dim": 64, "n_layers": 2, "n_heads": 4},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 16},
    "gptj": {"rotary_dim": 4},
    "codegen": {"rotary_dim": 4},
    "deepseek_v2": {"num_key_value_heads": 4},
    "deepseek_v3": {"num_key_value_heads": 4},
    "t5": {"decoder_start_token_id": 0},
    "switch_transformers": {"decoder_start_token_id": 0, "num_sparse_encoder_layers": 1,
                            "num_sparse_decoder_layers": 1},
    "funnel": {"block_sizes": [1, 1], "d_head": 8, "d_inner": 64, "num_decoder_layers": 1},
    "xlnet": {"d_inner": 64, "n_layer": 2},
    "longformer": {"attention_window": [8, 8]},
    "led": {"attention_window": [8, 8], "max_encoder_position_embeddings": 128,
            "max_decoder_position_embeddings": 128},
    "big_bird": {"attention_type": "original_full"},
    "bigbird_pegasus": {"attention_type": "original_full"},
    "reformer": {"attn_layers": ["local", "lsh"], "axial_pos_shape": [8, 8],
                 "axial_pos_embds_dim": [16, 16], "feed_forward_size": 64,
                 "attention_head_size": 8, "local_attn_chunk_length": 16,
                 "lsh_attn_chunk_length": 16, "num_buckets": 4},
    "mamba2": {"num_heads": 8, "head_dim": 8, "n_groups": 1, "state_size": 16, "chunk_size": 16},
    "bamba": {"mamba_n_heads": 8, "mamba_d_head": 8, "mamba_n_groups": 1, "mamba_chunk_size": 16,
              "attn_layer_indices": [1]},
    "falcon_h1": {"mamba_n_heads": 8, "mamba_d_head": 8, "mamba_n_groups": 1,
                  "mamba_chunk_size": 16, "mamba_d_ssm": 64},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
              "expert_layer_offset": 1, "mamba_dt_rank": 4},
    "recurrent_gemma": {"lru_width": 32, "attention_window_size": 16, "block_types":
                        ["recurrent", "attention"]},
    "rwkv": {"attention_hidden_size": 32, "context_length": 128},
    "phi3": {"original_max_position_embeddings": 128},
    # vision: per-stage lists
    "swin": {"embed_dim": 16, "depths": [1, 1], "num_heads": [2, 2], "window_size": 4},
    "swinv2": {"embed_dim": 16, "depths": [1, 1], "num_heads": [2, 2], "window_size": 4},
    "focalnet": {"embed_dim": 16, "depths": [1, 1], "hidden_sizes": [16, 32]},
    "convnext": {"hidden_sizes": [16, 32], "depths": [1, 1], "num_stages": 2},
    "convnextv2": {"hidden_sizes": [16, 32], "depths": [1, 1], "num_stages": 2},
    "resnet": {"embedding_size": 16, "hidden_sizes": [16, 32], "depths": [1, 1],
               "layer_type": "basic"},
    "regnet": {"embedding_size": 16, "hidden_sizes": [16, 32], "depths": [1, 1],
               "groups_width": 8},
    "poolformer": {"hidden_sizes": [16, 32], "depths": [1, 1], "num_encoder_blocks": 2,
                   "patch_sizes": [4, 2], "strides": [4, 2], "padding": [1, 0],
                   "num_attention_heads": [1, 2]},
    "segformer": {"hidden_sizes": [16, 32], "depths": [1, 1], "num_encoder_blocks": 2,
                  "sr_ratios": [2, 1], "num_attention_heads": [1, 2], "patch_sizes": [7, 3],
                  "strides": [4, 2], "mlp_ratios": [2, 2], "decoder_hidden_size": 32},
    "pvt": {"hidden_sizes": [16, 32], "depths": [1, 1], "num_encoder_blocks": 2,
            "sequence_reduction_ratios": [2, 1], "num_attention_heads": [1, 2],
            "patch_sizes": [4, 2], "strides": [4, 2], "mlp_ratios": [2, 2]},
    "levit": {"hidden_sizes": [16, 32, 48], "num_attention_heads": [1, 2, 3],
              "depths": [1, 1, 1], "key_dim": [8, 8, 8], "patch_size": 16, "image_size": 64},
    "mobilevit": {"hidden_sizes": [32, 32, 32], "neck_hidden_sizes": [8, 8, 16, 16, 16, 32, 32],
                  "num_attention_heads": 2, "patch_size": 2, "conv_kernel_size": 3},
    "efficientnet": {"hidden_dim": 64, "width_coefficient": 0.25, "depth_coefficient": 0.25,
                     "image_size": 32},
    "bit": {"embedding_size": 16, "hidden_sizes": [16, 32], "depths": [1, 1],
            "layer_type": "bottleneck", "out_features": ["stage1", "stage2"]},
    "cvt": {"embed_dim": [16, 32], "num_heads": [1, 2], "depth": [1, 1],
            "patch_sizes": [7, 3], "patch_stride": [4, 2], "patch_padding": [2, 1],
            "mlp_ratio": [2.0, 2.0], "attention_drop_rate": [0.0, 0.0], "drop_rate": [0.0, 0.0],
            "drop_path_rate": [0.0, 0.0], "qkv_bias": [True, True], "cls_token": [False, True],
            "qkv_projection_method": ["dw_bn", "dw_bn"], "kernel_qkv": [3, 3],
            "padding_kv": [1, 1], "stride_kv": [2, 2], "padding_q": [1, 1], "stride_q": [1, 1]},
    "hiera": {"embed_dim": 16, "depths": [1, 1], "num_heads": [1, 2], "patch_stride": [4, 4],
              "patch_size": [7, 7], "patch_padding": [3, 3], "image_size": [32, 32],
              "masked_unit_size": [2, 2], "query_stride": [2, 2], "embed_dim_multiplier": 2.0,
              "num_heads_multiplier": 2.0},
    # audio: a small convolutional front end
    "wav2vec2": {"conv_dim": [16, 16], "conv_stride": [4, 4], "conv_kernel": [8, 4],
                 "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 4,
                 "ctc_zero_infinity": True},
    "hubert": {"conv_dim": [16, 16], "conv_stride": [4, 4], "conv_kernel": [8, 4],
               "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 4,
               "ctc_zero_infinity": True},
    "wavlm": {"conv_dim": [16, 16], "conv_stride": [4, 4], "conv_kernel": [8, 4],
              "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 4,
              "num_buckets": 16, "max_bucket_distance": 32, "ctc_zero_infinity": True},
    "data2vec-audio": {"conv_dim": [16, 16], "conv_stride": [4, 4], "conv_kernel": [8, 4],
                       "num_conv_pos_embeddings": 4, "num_conv_pos_embedding_groups": 4,
                       "conv_pos_kernel_size": 3, "num_conv_pos_embeddings_layers": 1,
                       "ctc_zero_infinity": True},
    "unispeech": {"conv_dim": [16, 16], "conv_stride": [4, 4], "conv_kernel": [8, 4],
                  "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 4,
                  "ctc_zero_infinity": True},
    "sew": {"conv_dim": [16, 16], "conv_stride": [4, 4], "conv_kernel": [8, 4],
            "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 4,
            "squeeze_factor": 2, "ctc_zero_infinity": True},
    "whisper": {"num_mel_bins": 16, "encoder_layers": 2, "decoder_layers": 2,
                "max_source_positions": 32},
    "speech_to_text": {"input_feat_per_channel": 16, "num_conv_layers": 2,
                       "conv_channels": 16, "conv_kernel_sizes": [5, 5]},
}  # fmt: skip


@dataclass(frozen=True)
class Architecture:
    """One row of the sweep: transformers' ``model_type``, its family, and the task whose head
    computes the loss (the auto mapping its model class is taken from)."""

    name: str
    family: str
    task: str


#: The task's auto mapping in ``transformers.models.auto.modeling_auto`` (names, not classes).
TASKS = {
    "causal_lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked_lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "seq2seq_lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "image_classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "ctc": "MODEL_FOR_CTC_MAPPING_NAMES",
    "speech_seq2seq": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "contrastive": "MODEL_MAPPING_NAMES",
}


def _rows(family: str, task: str, names: str) -> list[Architecture]:
    return [Architecture(n, family, task) for n in names.split()]


#: Every architecture the sweep trains, by family.
ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in [
        *_rows(
            "decoder",
            "causal_lm",
            "gpt2 gpt_neo gpt_neox gptj opt bloom falcon codegen xglm biogpt mpt llama mistral "
            "qwen2 qwen3 gemma gemma2 gemma3_text phi phi3 starcoder2 stablelm olmo olmo2 cohere "
            "granite persimmon nemotron glm glm4 helium smollm3 ministral arcee",
        ),
        *_rows(
            "MoE",
            "causal_lm",
            "mixtral qwen2_moe qwen3_moe olmoe granitemoe phimoe deepseek_v2 deepseek_v3 jetmoe "
            "hunyuan_v1_moe ernie4_5_moe glm4_moe",
        ),
        *_rows(
            "state-space", "causal_lm", "mamba mamba2 falcon_mamba jamba bamba falcon_h1 lfm2 rwkv"
        ),
        *_rows(
            "encoder",
            "masked_lm",
            "bert roberta distilbert albert electra deberta deberta-v2 xlm-roberta mpnet funnel "
            "megatron-bert rembert roformer squeezebert ernie modernbert mobilebert convbert "
            "data2vec-text esm",
        ),
        *_rows(
            "seq2seq",
            "seq2seq_lm",
            "t5 mt5 umt5 bart mbart pegasus marian blenderbot blenderbot-small m2m_100 plbart "
            "prophetnet switch_transformers nllb-moe",
        ),
        *_rows(
            "vision",
            "image_classification",
            "vit deit beit dinov2 swin swinv2 convnext convnextv2 resnet regnet poolformer "
            "segformer focalnet levit mobilevit data2vec-vision",
        ),
        *_rows("audio", "ctc", "wav2vec2 hubert wavlm data2vec-audio unispeech sew"),
        *_rows("audio", "speech_seq2seq", "whisper speech_to_text"),
        *_rows("multimodal", "contrastive", "clip siglip"),
    ]
}


def tiny_config(name: str, **extra: Any) -> Any:
    """The architecture's config with its defaults, shrunk by :data:`SMALL`, then
    :data:`OVERRIDES` and ``extra``. Sub-configs (``text_config``, ``vision_config``) are
    shrunk the same way."""
    from transformers import AutoConfig

    base = AutoConfig.for_model(name)
    return _shrunk(type(base), base, {**OVERRIDES.get(name, {}), **extra})


def _shrunk(cls: type, base: Any, extra: dict[str, Any]) -> Any:
    fields = base.to_dict()
    kwargs: dict[str, Any] = {}
    for key, value in SMALL.items():
        if key in fields and _same_kind(fields[key], value):
            kwargs[key] = value
    for key in ("text_config", "vision_config"):
        sub = getattr(base, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            kwargs[key] = _shrunk(type(sub), sub, {}).to_dict()
    kwargs.update(extra)
    return cls(**kwargs)


def _same_kind(default: Any, small: Any) -> bool:
    """Shrink a field only where the small value has the default's kind (an int where an int,
    never an int where a config holds a list of per-layer sizes); an unset (None) default takes
    the small value."""
    if default is None:
        return True
    if isinstance(default, bool) or isinstance(small, bool):
        return isinstance(default, bool) and isinstance(small, bool)
    return isinstance(default, type(small)) or (
        isinstance(default, float) and isinstance(small, int)
    )


def model_class(arch: Architecture) -> type:
    """The class with the task's head, as transformers' auto mapping names it."""
    import transformers
    from transformers.models.auto import modeling_auto

    mapping = getattr(modeling_auto, TASKS[arch.task])
    if arch.name not in mapping:
        raise KeyError(
            f"transformers {transformers.__version__} has no {arch.task} model for "
            f"{arch.name!r} ({TASKS[arch.task]})"
        )
    cls_name = mapping[arch.name]
    return getattr(transformers, cls_name if isinstance(cls_name, str) else cls_name[0])


def build(name: str) -> torch.nn.Module:
    """The architecture's tiny model with its task's head, weights drawn under seed 0, in
    training mode."""
    arch = ARCHITECTURES[name]
    config = tiny_config(name)
    cls = model_class(arch)
    torch.manual_seed(0)
    model = cls(config)
    return model.train()


def make_inputs(
    name: str, model: torch.nn.Module, batch: int = 2, length: int = 64
) -> dict[str, torch.Tensor]:
    """A batch for the model's task with ``labels``: ``batch`` rows of ``length`` tokens (text),
    32 x 32 images (vision: 64 patches), ``length * 16`` samples (CTC audio) or ``length``
    frames of mel features (speech seq2seq); drawn from a generator seeded 1."""
    arch = ARCHITECTURES[name]
    config: Any = model.config
    g = torch.Generator().manual_seed(1)
    if arch.task in ("causal_lm", "masked_lm", "seq2seq_lm"):
        vocab = config.get_text_config().vocab_size
        ids = torch.randint(3, vocab, (batch, length), generator=g)
        if arch.task == "seq2seq_lm":
            labels = torch.randint(3, vocab, (batch, length // 2), generator=g)
            return {"input_ids": ids, "labels": labels}
        return {"input_ids": ids, "labels": ids.clone()}
    if arch.task == "image_classification":
        size = getattr(config, "image_size", 32)
        size = size[0] if isinstance(size, (list, tuple)) else size
        pixels = torch.randn(batch, config.num_channels, size, size, generator=g)
        labels = torch.randint(0, config.num_labels, (batch,), generator=g)
        return {"pixel_values": pixels, "labels": labels}
    if arch.task == "ctc":
        audio = torch.randn(batch, length * 16, generator=g)
        labels = torch.randint(3, config.vocab_size, (batch, length // 8), generator=g)
        return {"input_values": audio, "labels": labels}
    if arch.task == "speech_seq2seq":
        bins = getattr(config, "num_mel_bins", None) or config.input_feat_per_channel
        frames = 2 * config.max_source_positions if name == "whisper" else length
        features = torch.randn(batch, bins, frames, generator=g)
        if name == "speech_to_text":
            features = features.transpose(1, 2).contiguous()
        labels = torch.randint(3, config.vocab_size, (batch, length // 4), generator=g)
        return {"input_features": features, "labels": labels}
    if arch.task == "contrastive":
        text = config.text_config
        ids = torch.randint(3, text.vocab_size, (batch, min(length, 16)), generator=g)
        size = config.vision_config.image_size
        pixels = torch.randn(batch, 3, size, size, generator=g)
        return {"input_ids": ids, "pixel_values": pixels, "return_loss": True}  # type: ignore[dict-item]
    raise ValueError(f"no inputs for task {arch.task!r}")
