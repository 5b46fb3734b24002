"""What is alive, and what gets a gradient, when a graph's backward starts.

A joint graph says what the forward returns, not what the caller does with it. Two loops run the
same model: ``model(**batch).loss.backward()`` (Hugging Face's ``Trainer``, Lightning) drops the
output object before the backward, so the logits and the key/value cache are gone when it starts
and only the loss gets a gradient; ``out = model(x); loss_fn(out, y).backward()`` holds ``out``
through the backward and gives it a gradient. The executor runs each as eager would: an output
without a gradient gets no tangent, and the backward runs specialized to that
(``capture.tangents``). Simulated as if every output were held and got a gradient, a plan's
predicted peak on Hugging Face models was 17-23% above the measured step (GPT-2, Llama, Llama +
LoRA, CPU; ``docs/measurements.md``): the logits and cache kept to the end of
the backward, and their tangents counted at its start. The planner also chose among plans by
those numbers (corrected for the outputs alone, Llama took a plan that measured 6% higher).

``BackwardStart`` (plain data, in ``analysis.graph`` beside the ``JointGraph`` that carries it)
is what one graph's step does: which outputs the caller no longer holds, and which tangents
arrive as None. Before any backward has run it is assumed (``assumed_start``), and
the executor checks the assumption on the graph's first backward (``execution.start_watch``),
planning again where it was wrong by enough to matter. ``running_backward`` is the joint graph's
backward as it then runs, for the simulator to walk (``analysis.simulate``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from memfit._compat import StorageWeakRef, tree_flatten
from memfit.analysis.graph import BackwardStart, JointGraph, node_tensors
from memfit.capture.tangents import without_tangents

__all__ = [
    "BackwardView",
    "assumed_start",
    "returns_loss",
    "running_backward",
    "start_of",
]


def _is_scalar(node: fx.Node) -> bool:
    tensors = node_tensors(node)
    return len(tensors) == 1 and tensors[0].dim() == 0 and tensors[0].is_floating_point()


def returns_loss(jg: JointGraph) -> bool:
    """Whether ``jg`` returns a scalar that gets a gradient: the model computes its own loss."""
    return any(_is_scalar(t) for t in jg.tangents)


def assumed_start(jg: JointGraph) -> BackwardStart:
    """The start assumed before a backward of ``jg`` has been seen.

    A graph that returns a scalar with a gradient computes its own loss (a Hugging Face model
    given ``labels``): the loops that train such models (``Trainer``, accelerate, Lightning,
    ``model(**batch).loss.backward()``) give only the loss a gradient, and most drop the other
    outputs before the backward. Otherwise the loss is computed outside from the outputs, which
    are held through the backward and get gradients. The first backward says which was right.
    """
    if not returns_loss(jg):
        return BackwardStart()
    missing = frozenset(t.name for t in jg.tangents if not _is_scalar(t))
    dropped = frozenset(n.name for n in jg.fwd_outputs if not _is_scalar(n))
    return BackwardStart(dropped=dropped, missing=missing)


def start_of(jg: JointGraph) -> BackwardStart:
    """``jg``'s backward start: observed or assumed (``jg.backward_start``), else every output
    held and given a gradient."""
    return jg.backward_start if jg.backward_start is not None else BackwardStart()


@dataclass
class BackwardView:
    """The joint graph's backward as it runs when some tangents are None, in ``jg``'s terms.

    A node of the specialized graph that ``jg`` also has is ``jg``'s node (its storages, its
    scratch, its cost); the zero tensors the specialization makes for an op that needs one are
    nodes of their own, with the storage of the value they stand for. Inputs are the
    specialized graph's: an op may now read a zero tensor, or a value in place of a sum.
    """

    #: every node that is not a placeholder or the output, in graph order
    nodes: list[fx.Node]
    inputs: dict[fx.Node, list[fx.Node]]
    #: nodes that depend on a tangent that is given
    backward: set[fx.Node]
    #: the gradients it returns (those that are not None)
    outputs: list[fx.Node]
    #: storages of the nodes ``jg`` does not have
    storages: dict[fx.Node, list[int]]


def running_backward(jg: JointGraph) -> BackwardView | None:
    """The backward that runs for ``jg.backward_start``'s missing tangents; None when none is
    missing (``jg``'s own backward runs). Specialized once per set of missing tangents."""
    missing = start_of(jg).missing & {t.name for t in jg.tangents}
    if not missing:
        return None
    cache: dict[frozenset[str], BackwardView] = jg.derived.setdefault("running_backward", {})
    if missing not in cache:
        cache[missing] = _view(jg, frozenset(missing))
    return cache[missing]


def _view(jg: JointGraph, missing: frozenset[str]) -> BackwardView:
    specialized = without_tangents(jg.module, set(missing))
    ours = {n.name: n for n in jg.nodes}
    mapped: dict[fx.Node, fx.Node] = {}
    storages: dict[fx.Node, list[int]] = {}
    for n in specialized.graph.nodes:
        own = ours.get(n.name)
        if own is not None and own.op == n.op and own.target == n.target:
            mapped[n] = own
            continue
        mapped[n] = n
        storages[n] = [
            jg._storage_ids[StorageWeakRef(t.untyped_storage())] for t in node_tensors(n)
        ]
    given = {mapped[n] for n in specialized.graph.nodes if n.op == "placeholder"} & {
        t for t in jg.tangents if t.name not in missing
    }
    backward: set[fx.Node] = set(given)
    nodes: list[fx.Node] = []
    inputs: dict[fx.Node, list[fx.Node]] = {}
    outputs: list[fx.Node] = []
    for n in specialized.graph.nodes:
        m = mapped[n]
        if n.op == "placeholder":
            continue
        reads = [mapped[a] for a in n.all_input_nodes]
        if n.op == "output":
            outs, _ = tree_flatten(n.args[0])
            outputs = [mapped[o] for o in outs[jg.num_fwd_outputs :] if isinstance(o, fx.Node)]
            continue
        nodes.append(m)
        inputs[m] = reads
        if any(a in backward for a in reads):
            backward.add(m)
    backward -= given
    return BackwardView(nodes, inputs, backward, outputs, storages)
