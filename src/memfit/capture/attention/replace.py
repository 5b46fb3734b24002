"""The attention pass: every softmax and SDPA call of a Dynamo graph matched, rewritten to its
kernel, and reported, rewritten or not.

Part of ``memfit.capture.attention``: see its docstring.
"""

from __future__ import annotations

import torch.fx as fx

from memfit.capture.attention.additive_rewrite import match_additive, rewrite_additive
from memfit.capture.attention.dynamo_nodes import (
    MATMUL,
    SDPA_CALL,
    SOFTMAX,
    TANH,
    argument,
    fed_by,
    is_call,
    location,
    shape_of,
    shown,
)
from memfit.capture.attention.kernel import rewrite_dot_product, rewrite_sdpa_call
from memfit.capture.attention.match import Skip, match_dot_product
from memfit.capture.attention.site import ADDITIVE, AttentionSite
from memfit.capture.edit import recompiled

__all__ = ["replace_attention"]


def replace_attention(gm: fx.GraphModule) -> list[AttentionSite]:
    """Rewrite, in place, every attention in a Dynamo graph; return what was found and done."""
    sites: list[AttentionSite] = []
    for node in list(gm.graph.nodes):
        if node.graph is not gm.graph or node.op == "output":
            continue
        if is_call(node, SDPA_CALL):
            sites.append(rewrite_sdpa_call(gm, node))
        elif is_call(node, SOFTMAX):
            where, shape = location(node), shown(shape_of(argument(node, 0, "input")) or ())
            try:
                m = match_dot_product(node)
            except Skip as skip:
                try:
                    additive = match_additive(node)
                except Skip as not_additive:
                    if fed_by(node, TANH):
                        sites.append(AttentionSite(where, None, str(not_additive), shape))
                    elif fed_by(node, MATMUL):
                        sites.append(AttentionSite(where, None, str(skip), shape))
                    continue
                rewrite_additive(gm, additive)
                reason = "additive attention: the tanh block is recomputed in backward"
                sites.append(AttentionSite(where, ADDITIVE, reason, shape))
                continue
            kernel, reason = rewrite_dot_product(gm, m)
            sites.append(AttentionSite(where, kernel, reason, shape, m.dropout_p))
    recompiled(gm, len(sites))
    return sites
