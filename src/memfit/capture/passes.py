"""The rewrites of a joint graph that run before analysis and planning.

Anything that changes which values exist, or which can be recomputed, must happen before memfit
simulates and plans: a rewrite after planning would leave the plan describing a graph that no
longer runs. Four kinds of rewrite exist, in this order:

1. ``strip_marks``: ``memfit.mark`` nodes are removed and the values they marked are tagged, so
   the ``"collection"`` policy can keep them and no mark op ever runs;
2. for the Inductor executor only, what ``torch.compile`` does to a joint graph before it
   partitions it (``_compat.inductor_joint_graph_passes``: Inductor's joint-graph rewrites, dead
   code dropped), then the backward's repeated computations merged (``capture.merge``; not
   ``torch.compile``'s merge of every common subexpression, which raised the transformer's
   least peak). Why: Inductor fuses the graph it is given, and the same partition of another
   graph fuses differently. On the frontier's ResNet, memfit's ``budget=0.6`` kept exactly what
   ``torch.compile`` keeps at ``activation_memory_budget=0.8``, yet five of its 19 backward
   kernels differed from ``torch.compile``'s, and in seven frontier runs its step read
   0.98-1.04x ``torch.compile``'s (median 1.02). Rewritten first, the backward is
   ``torch.compile``'s code but for the copy that gives weight gradients eager's layout
   (``executors._keep_eager_layouts``). The eager executor runs eager's ops as they are;
3. for the eager executor only, ``eager_cpu_dropout_backward``: a CPU dropout's backward written
   as eager CPU computes it, its scale rounded to the gradient's dtype, and
   ``recomputable_cpu_dropout``: its result made from its mask by an op a plan can recompute
   (``capture.dropout``); Inductor decomposes dropout its own way; ``eager_strides``: the
   layouts eager's kernels give where a fake tensor's differ, and the copies only the fake layout
   made turned back into the views eager makes (``capture.eager_strides``); and
   ``mark_inplace_sums``: gradient sums eager autograd makes in place, tagged to be made in place
   (``capture.inplace_sums``);
4. ``add_batchnorm_twins``: every training BatchNorm gets a twin that can be recomputed without
   touching the running statistics, and each training BatchNorm's backward is handed no
   statistics, which it never reads, so the new ones are not kept for it from the forward
   (``capture.batchnorm``). Under Inductor, BatchNorm is decomposed before memfit sees the graph
   (``executors.decompositions``): nothing to twin or to drop.
"""

from __future__ import annotations

import torch.fx as fx

from memfit._compat import inductor_joint_graph_passes
from memfit.capture.batchnorm import add_batchnorm_twins, drop_backward_statistics
from memfit.capture.dropout import eager_cpu_dropout_backward, recomputable_cpu_dropout
from memfit.capture.eager_strides import eager_strides
from memfit.capture.inplace_sums import mark_inplace_sums
from memfit.capture.mark import strip_marks
from memfit.capture.merge import merge_backward_duplicates

__all__ = ["prepare_joint_graph"]


def prepare_joint_graph(joint: fx.GraphModule, *, inductor: bool = False) -> None:
    """Apply, in place, every rewrite that must precede analysis and planning (see above);
    ``inductor``: the graph is planned for the Inductor executor."""
    strip_marks(joint)
    if inductor:
        inductor_joint_graph_passes(joint)
        merge_backward_duplicates(joint)
    else:
        eager_cpu_dropout_backward(joint)
        recomputable_cpu_dropout(joint)
        eager_strides(joint)
        mark_inplace_sums(joint)
    add_batchnorm_twins(joint)
    drop_backward_statistics(joint)
