"""``attn_implementation="memfit"`` for HuggingFace transformers.

HuggingFace models pick their attention kernel by name from a registry
(``transformers.AttentionInterface``), and build their masks in the format that kernel expects
(``transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS``). Registering memfit's attention
there lets any model that supports ``"sdpa"`` train with ``memfit.nn.attention`` instead: SDPA's
fused kernel where it applies and memfit's chunked one where SDPA would silently store the L x L
probabilities (dropout on CPU, masks that require grad, position biases). The masks are SDPA's.

Registration happens when memfit is imported after transformers, or by calling
``memfit.nn.register_huggingface()``; importing transformers just for this would cost seconds on
every ``import memfit``.
"""

from __future__ import annotations

from typing import Any

import torch

from memfit.nn.attention import attention

__all__ = ["register_huggingface", "memfit_attention_forward", "IMPLEMENTATION"]

#: The name to pass as ``attn_implementation``.
IMPLEMENTATION = "memfit"


def memfit_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    position_bias: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HuggingFace's attention-function contract: [B, H, L, D] in, [B, L, H, Dv] out."""
    if kwargs.get("softcap") is not None:
        raise ValueError("memfit attention has no softcap; use attn_implementation='eager' for it")
    if kwargs.get("output_attentions", False):
        raise ValueError(
            "memfit attention never materialises the attention probabilities, so it cannot "
            "return them: use attn_implementation='eager' for output_attentions=True"
        )
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    q_length = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(q_length > 1 and attention_mask is None and causal)
    if position_bias is not None:
        from transformers.integrations.sdpa_attention import create_position_bias_mask

        attention_mask = create_position_bias_mask(
            position_bias, attention_mask, causal, query, key
        )
        causal = False
    out = attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        is_causal=causal,
        scale=scaling,
    )
    return out.transpose(1, 2).contiguous(), None


def register_huggingface() -> bool:
    """Register ``attn_implementation="memfit"`` with transformers; False if it is not installed."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    except ImportError:
        return False
    AttentionInterface.register(IMPLEMENTATION, memfit_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(IMPLEMENTATION, sdpa_mask)
    return True
