"""Apply a plan to a joint graph: the forward graph that saves what the plan says, and the
backward graph that recomputes the rest just in time.

The split itself is AOTAutograd's own ``_extract_fwd_bwd_modules`` (through ``memfit._compat``),
the function behind its default and min-cut partitioners: it knows the calling convention between
the forward graph, the autograd.Function that runs it and the backward graph, which has changed
across torch releases. memfit hands it exactly the values the plan decides ``SAVE``; whatever the
backward needs beyond them, the split copies into the backward graph, and that is the
recomputation. Two mechanical steps follow, both modelled by the simulator that predicted the
plan's peak: BatchNorm twins (``capture.batchnorm``) take their values from the original op in the
forward graph, and the backward graph is reordered with the same ``order_backward`` the simulator
replays, so what runs is what was predicted.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch.fx as fx

from memfit._compat import extract_fwd_bwd_modules, is_tangent
from memfit.analysis.simulate import order_backward
from memfit.capture.batchnorm import FORWARD_TWIN
from memfit.execution.offload import JOINT_NAME, OffloadStore, insert_transfers
from memfit.planning.decision import Decision
from memfit.planning.plan import GraphPlan

__all__ = ["split_joint_graph", "reorder_backward_graph", "PlanMismatchError"]


class PlanMismatchError(ValueError):
    """A plan names values the graph it is applied to does not have: it was made for another."""


def split_joint_graph(
    joint: fx.GraphModule,
    plan: GraphPlan,
    *,
    num_fwd_outputs: int,
    static_lifetime_input_indices: Iterable[int] | None = None,
    store: OffloadStore | None = None,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Forward and backward graph modules of ``joint`` that follow ``plan``'s decisions.

    Values decided ``OFFLOAD`` are split as saved values, then their transfers are inserted
    (``execution.offload``) into ``store``, which a plan with transfers requires.
    """
    nodes = {n.name: n for n in joint.graph.nodes}
    missing = [name for name in plan.decisions if name not in nodes]
    if missing:
        raise PlanMismatchError(
            f"the plan decides {len(missing)} value(s) this graph does not have "
            f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}): a plan applies only "
            f"to the graph it was made for"
        )
    passed = (Decision.SAVE, Decision.OFFLOAD)
    saved = [n for n in joint.graph.nodes if plan.decisions.get(n.name) in passed]
    fw, bw = extract_fwd_bwd_modules(
        joint,
        saved,
        num_fwd_outputs=num_fwd_outputs,
        static_lifetime_input_indices=static_lifetime_input_indices,
    )
    fw.graph.eliminate_dead_code()
    take_twins_from_originals(fw)
    fw.recompile()
    bw.graph.eliminate_dead_code()
    bw = reorder_backward_graph(bw)
    if plan.transfers:
        if store is None:
            raise ValueError("this plan offloads values: split_joint_graph needs an OffloadStore")
        insert_transfers(
            fw,
            bw,
            [(t.value, t.wait_after, t.prefetch_before) for t in plan.transfers],
            store,
            num_fwd_outputs=num_fwd_outputs,
        )
    return fw, bw


def take_twins_from_originals(gm: fx.GraphModule) -> int:
    """In a forward graph, read each BatchNorm twin's results from its original op; drop the twin.

    The twin repeats the original's first results bit for bit, so the forward runs one kernel as
    eager PyTorch does; the twin only runs where the backward recomputes it. Returns how many
    twins were replaced.
    """
    graph = gm.graph
    by_name = {n.name: n for n in graph.nodes}
    replaced = 0
    for twin in [n for n in graph.nodes if FORWARD_TWIN in n.meta]:
        original = by_name.get(twin.meta[FORWARD_TWIN])
        if original is None:  # the original is not in this graph: the twin must run
            continue
        for item in list(twin.users):
            assert item.target is operator.getitem, item.format_node()
            with graph.inserting_after(original):
                taken = graph.call_function(operator.getitem, (original, item.args[1]))
            taken.meta = dict(item.meta)
            taken.meta[JOINT_NAME] = item.name  # the plan names values as the joint graph did
            item.replace_all_uses_with(taken)
            graph.erase_node(item)
        graph.erase_node(twin)
        replaced += 1
    if replaced:
        graph.lint()
    return replaced


def reorder_backward_graph(bw: fx.GraphModule) -> fx.GraphModule:
    """Reorder ``bw`` so each recomputed value is born right before the gradient that reads it."""
    graph = bw.graph
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output = next(n for n in nodes if n.op == "output")
    tangent_dependent: set[fx.Node] = {p for p in placeholders if is_tangent(p)}
    for n in nodes:
        if n.op == "call_function" and any(a in tangent_dependent for a in n.all_input_nodes):
            tangent_dependent.add(n)
    body = [n for n in nodes if n.op not in ("placeholder", "output")]
    order = order_backward(
        body,
        lambda n: n in tangent_dependent and n.op == "call_function",
        set(placeholders),
        output.all_input_nodes,
    )
    new_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in placeholders + order + [output]:
        env[n] = new_graph.node_copy(n, lambda x: env[x])
    new_graph.lint()
    return fx.GraphModule(bw, new_graph)
