"""The rewrites of a joint graph that run before analysis and planning.

Anything that changes which values exist, or which can be recomputed, must happen before memfit
simulates and plans: a rewrite after planning would leave the plan describing a graph that no
longer runs. Two such rewrites exist, in this order:

1. ``strip_marks``: ``memfit.mark`` nodes are removed and the values they marked are tagged, so
   the ``"collection"`` policy can keep them and no mark op ever runs;
2. ``add_batchnorm_twins``: every training BatchNorm gets a twin that can be recomputed without
   touching the running statistics (``capture.batchnorm``).
"""

from __future__ import annotations

import torch.fx as fx

from memfit.capture.batchnorm import add_batchnorm_twins
from memfit.capture.mark import strip_marks

__all__ = ["prepare_joint_graph"]


def prepare_joint_graph(joint: fx.GraphModule) -> None:
    """Apply, in place, every rewrite that must precede analysis and planning (see above)."""
    strip_marks(joint)
    add_batchnorm_twins(joint)
