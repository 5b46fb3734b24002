"""memfit.nn: memory-linear kernels and modules a user can call directly.

The capture passes (``memfit.capture.attention``, ``memfit.capture.loss_head``) rewrite naive
attention and a language model's loss head found in a model's graph into these kernels; the same
kernels are public so a model can use them without capture.
"""

from memfit.nn.additive import AdditiveAttention as AdditiveAttention
from memfit.nn.additive import additive_attention as additive_attention
from memfit.nn.attention import attention as attention
from memfit.nn.chunked_attention import chunked_attention as chunked_attention
from memfit.nn.dropout_mask import attention_dropout_mask as attention_dropout_mask
from memfit.nn.huggingface import register_huggingface as register_huggingface
from memfit.nn.linear_cross_entropy import linear_cross_entropy as linear_cross_entropy

__all__ = [
    "attention",
    "chunked_attention",
    "attention_dropout_mask",
    "additive_attention",
    "AdditiveAttention",
    "register_huggingface",
    "linear_cross_entropy",
]
