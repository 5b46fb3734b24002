"""Find attention in a captured model and rewrite it to a kernel that keeps no Lq x Lk tensor.

Naive attention, ``softmax(q @ k^T * scale + mask) @ v``, keeps its [.., Lq, Lk] probabilities
(and often the scores) for backward: the only quadratic tensors in a transformer's step, and at
long sequence lengths nearly all of its memory. Many models still write it out (HuggingFace's
``attn_implementation="eager"``, ``output_attentions``, older architectures, hand-written
layers), and PyTorch's own SDPA silently takes the same quadratic path for dropout, 3-D inputs
and a value head dim unlike the query's.

The pass reads the Dynamo graph, before AOTAutograd, where the model's own torch calls are still
visible. It finds attention semantically rather than by template: a softmax over the last dim
whose input comes from ``a @ b`` through any chain of scale (multiply or divide), additive mask,
``masked_fill``/``where`` and casts, and whose output, through optional casts and dropout, is read
only by ``@ v``. That one rule covers fused or split q/k/v projections, scale on q or on the
scores, causal masks sliced from a buffer, padding masks, and HuggingFace's eager attention.
Each site is rewritten to

- SDPA restricted to its fused kernels, when the chain is ``scale`` then at most one mask that
  SDPA can take and no dropout runs (``memfit.nn.attention.why_not_fused_sdpa`` decides);
- otherwise memfit's chunked kernel, which replays the chain op by op on blocks of keys, with
  dropout masks drawn where the model drew them and exactly as ``F.dropout`` draws them.

Existing SDPA calls that would take the math path are sent to ``memfit.nn.attention`` too.
Sites whose probabilities have another reader (``output_attentions=True``) are left alone and
reported with the reason; nothing is replaced silently and nothing is skipped silently.

The modules, by job: ``dynamo_nodes`` reads a Dynamo graph (which torch call a node is, its shape,
where in the model it came from); ``match`` finds dot-product attention and ``additive_rewrite``
additive attention (and rewrites it); ``kernel`` chooses a dot-product site's kernel and rewrites
it, and ``gqa`` finds key/value heads an SDPA call's model repeated, which ``kernel`` passes
unrepeated with ``enable_gqa``; ``replace`` is the pass over a graph; ``site`` is what it reports.
"""

from __future__ import annotations

from memfit.capture.attention.replace import replace_attention
from memfit.capture.attention.site import (
    ADDITIVE,
    MEMFIT,
    SDPA,
    Attention,
    AttentionSite,
)

__all__ = ["AttentionSite", "replace_attention", "Attention", "SDPA", "MEMFIT", "ADDITIVE"]
