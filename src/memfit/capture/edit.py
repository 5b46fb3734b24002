"""The two graph edits every capture pass makes: a node's uses handed to another value and the
node dropped, and, once a pass changed anything, the graph checked and its code generated again.

One place for them, so that each pass (``mark``, ``dropout``, ``batchnorm``, ``merge``,
``attention``) says only what it rewrites, and no pass forgets the ``lint`` that catches a
dangling use, or recompiles a graph it left alone.
"""

from __future__ import annotations

import torch.fx as fx

__all__ = ["bypass", "recompiled"]


def bypass(node: fx.Node, by: fx.Node) -> None:
    """Every reader of ``node`` reads ``by`` instead, and ``node`` leaves its graph."""
    node.replace_all_uses_with(by)
    node.graph.erase_node(node)


def recompiled(gm: fx.GraphModule, changed: int) -> int:
    """``gm`` linted and its code generated again where a pass ``changed`` that many places (none:
    left as it is); returns ``changed``."""
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed
