"""Apply a plan to a joint graph: the forward graph that saves what the plan says, and the
backward graph that recomputes the rest just in time.

The split itself is AOTAutograd's own ``_extract_fwd_bwd_modules`` (through ``memfit._compat``),
the function behind its default and min-cut partitioners: it knows the calling convention between
the forward graph, the autograd.Function that runs it and the backward graph, which has changed
across torch releases. memfit hands it exactly the values the plan decides ``KEEP``; whatever the
backward needs beyond them, the split copies into the backward graph, and that is the
recomputation. Two mechanical steps follow, both modelled by the simulator that predicted the
plan's peak: BatchNorm twins (``capture.batchnorm``) take their values from the original op in the
forward graph, and the backward graph is reordered with the same ``order_backward`` the simulator
replays, so what runs is what was predicted.

Under Inductor one more step, before the split: a saved value that is a view of a forward input
(a Linear's ``t(weight)``) is passed as that input, and the backward takes the view again
(``bases_of_input_views``). The plan's bytes are the same (a view holds none of its own), and it is
what ``torch.compile``'s partitioner passes. Why: Inductor's generated code re-creates each saved
view on both sides (``reinterpret_tensor`` when the forward returns it and again when the backward
reads it), a Python call per view per step: on a 12-layer MLP of 16-wide Linears (CPU, one
thread, interleaved; steps under a millisecond) memfit's ``"none"`` took 1.345x
``torch.compile``'s step time with the views saved and 1.186x without. Only views of inputs:
a computed value's layout is Inductor's choice, and a view taken again of it in the backward
could need a copy.

After the split, the inputs whose storage stays put from call to call are marked (``STATIC_INPUT``:
parameters and buffers, and the saved values the forward computes) for the Inductor executor, as
``torch.compile``'s compilers tell Inductor: on a GPU Inductor checks the alignment of every other
input on every call. Of the saved values the forward computes, those whose storage nothing else
holds are marked donated (``DONATED``), as ``torch.compile``'s AOTAutograd finds its
``bw_donated_idxs``: Inductor may write the backward's own buffers into them once read.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Iterable
from collections.abc import Set as AbstractSet

import torch
import torch.fx as fx

from memfit._compat import (
    StorageWeakRef,
    extract_fwd_bwd_modules,
    is_sym_node,
    is_tangent,
    op_schema,
)
from memfit.analysis.graph import is_view_op
from memfit.analysis.simulate import order_backward
from memfit.capture.batchnorm import FORWARD_TWIN
from memfit.capture.inplace_sums import run_inplace_sums
from memfit.execution.executors import DONATED, STATIC_INPUT
from memfit.execution.offload import JOINT_NAME, OffloadStore, insert_transfers
from memfit.planning.decision import Decision
from memfit.planning.plan import GraphPlan

__all__ = [
    "split_joint_graph",
    "reorder_backward_graph",
    "bases_of_input_views",
    "PlanMismatchError",
]


class PlanMismatchError(ValueError):
    """A plan names values the graph it is applied to does not have: it was made for another."""


def split_joint_graph(
    joint: fx.GraphModule,
    plan: GraphPlan,
    *,
    num_fwd_outputs: int,
    static_lifetime_input_indices: Iterable[int] | None = None,
    store: OffloadStore | None = None,
    input_views_as_bases: bool = False,
    missing_tangents: AbstractSet[str] = frozenset(),
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Forward and backward graph modules of ``joint`` that follow ``plan``'s decisions.

    Values decided ``OFFLOAD`` are split as saved values, then their transfers are inserted
    (``execution.offload``) into ``store``, which a plan with transfers requires.
    ``input_views_as_bases`` (Inductor): saved views of forward inputs are passed as those inputs
    (``bases_of_input_views``). ``missing_tangents``: the tangents the plan's backward start
    expects as None (``analysis.backward_start``); the backward is ordered for them as the
    simulator orders it (``reorder_backward_graph``).
    """
    nodes = {n.name: n for n in joint.graph.nodes}
    missing = [name for name in plan.decisions if name not in nodes]
    if missing:
        raise PlanMismatchError(
            f"the plan decides {len(missing)} value(s) this graph does not have "
            f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}): a plan applies only "
            f"to the graph it was made for"
        )
    passed = (Decision.KEEP, Decision.OFFLOAD)
    saved = [n for n in joint.graph.nodes if plan.decisions.get(n.name) in passed]
    if input_views_as_bases:
        offloaded = {n for n in saved if plan.decisions[n.name] is Decision.OFFLOAD}
        saved = bases_of_input_views(saved, keep=offloaded)
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
    bw = reorder_backward_graph(bw, missing_tangents)
    run_inplace_sums(bw)  # tagged on the eager executor's joint graphs only
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
    _mark_static_inputs(joint, fw, bw, saved, plan, static_lifetime_input_indices)
    _mark_donated(fw, bw, num_fwd_outputs)
    return fw, bw


def _mark_static_inputs(
    joint: fx.GraphModule,
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    saved: list[fx.Node],
    plan: GraphPlan,
    static_lifetime_input_indices: Iterable[int] | None,
) -> None:
    """Mark (``STATIC_INPUT``) the inputs whose storage stays put from call to call: in ``fw``
    the parameters and buffers, in ``bw`` the saved values the forward computes or that are
    parameters or buffers.

    Why: ``torch.compile``'s compilers tell Inductor the same, and on a GPU Inductor checks the
    alignment of every input not so marked on every call, a Python line per input in a step bound
    by the host (the frontier's encoder passes about 270). Left unmarked, and checked, as
    ``torch.compile`` does not: saved forward inputs that are the caller's (a new tensor each
    step, which may start anywhere in its storage), offloaded values (they come back through
    memfit's transfers), tangents and the gradients added into; sizes are not tensors.
    """
    placeholders = [n for n in joint.graph.nodes if n.op == "placeholder"]
    fixed = {placeholders[i].name for i in static_lifetime_input_indices or ()}
    passed_on = {
        n.name
        for n in saved
        if (n.op != "placeholder" or n.name in fixed)
        and plan.decisions.get(n.name) is not Decision.OFFLOAD
        and not is_sym_node(n)
    }
    for graph, names in ((fw, fixed), (bw, passed_on)):
        for n in graph.graph.nodes:
            if n.op == "placeholder" and n.name in names:
                n.meta[STATIC_INPUT] = True


def _mark_donated(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int) -> None:
    """Mark (``DONATED``) the backward's inputs that are saved values no other tensor shares a
    storage with: not the forward's inputs, not what the user gets from the forward, not what
    the backward returns, and not another saved value (two views of one buffer).

    Why: ``torch.compile`` tells Inductor the same (AOTAutograd's ``bw_donated_idxs``, the same
    rule less the last clause), and Inductor then writes a backward buffer into a donated input
    after its last read instead of allocating one: on the frontier's ResNet (CPU) its backward
    reused two saved buffers memfit's allocated afresh. The backward's argument list is the only
    reference left to such a value, since AOTAutograd drops its own before the backward runs;
    a backward that keeps the graph (``retain_graph=True``) runs a compile without donation
    (``execution.runners``).
    """
    saved = [
        n
        for n in bw.graph.nodes
        if n.op == "placeholder"
        and n.meta.get(STATIC_INPUT)
        and isinstance(n.meta.get("val"), torch.Tensor)
    ]
    if not saved:
        return
    fw_output = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
    bw_output = next(n for n in reversed(bw.graph.nodes) if n.op == "output")
    others = [n for n in fw.graph.nodes if n.op == "placeholder"]
    others += [o for o in fw_output.args[0][:num_fwd_outputs] if isinstance(o, fx.Node)]
    others += [o for o in bw_output.args[0] if isinstance(o, fx.Node)]
    held = {_storage(n.meta.get("val")) for n in others}
    counts = Counter(_storage(n.meta["val"]) for n in saved)
    for n in saved:
        key = _storage(n.meta["val"])
        if key is not None and key not in held and counts[key] == 1:
            n.meta[DONATED] = True


def _storage(value: object) -> StorageWeakRef | None:
    """The identity of ``value``'s storage (fake or real), or None if it has none to share."""
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
        return None
    return StorageWeakRef(value.untyped_storage())


def bases_of_input_views(
    saved: list[fx.Node], keep: AbstractSet[fx.Node] | None = None
) -> list[fx.Node]:
    """``saved`` with each view of a forward input (through a chain of views whose only tensor
    argument is the one viewed) replaced by that input, in order, without repeats.

    The input is passed to the backward instead of its view, and the backward takes the view
    again (views are never kept for their own bytes: they hold none). Left as they are: ``keep``
    (offloaded values), tangents, inputs the graph mutates (a BatchNorm's running statistics:
    the backward would view the updated buffer), and views with sizes that are graph values
    (symbolic shapes), which the backward would also have to be passed.
    """
    out: list[fx.Node] = []
    seen: set[fx.Node] = set()
    for n in saved:
        base = None if keep and n in keep else _input_viewed(n)
        chosen = base if base is not None else n
        if chosen not in seen:
            seen.add(chosen)
            out.append(chosen)
    return out


def _input_viewed(node: fx.Node) -> fx.Node | None:
    """The forward input ``node`` is a chain of views of, or None."""
    current = node
    while current.op == "call_function":
        if not is_view_op(current):
            return None  # computes a value of its own (or Python glue such as getitem)
        first = current.args[0] if current.args else None
        # sizes that are graph values (symbolic shapes) come as nodes, often inside a list
        if not isinstance(first, fx.Node) or current.all_input_nodes != [first]:
            return None
        current = first
    if current is node or current.op != "placeholder" or is_tangent(current):
        return None
    return None if _mutated(current) else current


def _mutated(placeholder: fx.Node) -> bool:
    """Whether an op of the graph writes into ``placeholder`` in place, directly or through a
    view of it, with the tensor passed positionally or by keyword (an ``out=``)."""
    aliases = [placeholder]
    seen = {placeholder}
    while aliases:
        value = aliases.pop()
        for user in value.users:
            schema = op_schema(user.target)
            if schema is None:
                continue
            for i, arg in enumerate(schema.arguments):
                given = user.args[i] if i < len(user.args) else user.kwargs.get(arg.name)
                if given is not value or arg.alias_info is None:
                    continue
                if arg.alias_info.is_write:
                    return True
                if user not in seen:  # a view of it: writes into the view write into it
                    seen.add(user)
                    aliases.append(user)
    return False


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


def reorder_backward_graph(
    bw: fx.GraphModule, missing_tangents: AbstractSet[str] = frozenset()
) -> fx.GraphModule:
    """Reorder ``bw`` so each recomputed value is born right before the gradient that reads it.

    The tangents named in ``missing_tangents`` are expected to arrive as None: the backward then
    runs specialized to them (``capture.tangents``), which keeps this order and makes a zero
    tensor for an op that needs one right before that op. What reads only such tangents is
    ordered as a recomputed value is, right before the gradient that reads it, which is how the
    simulator walks the specialized backward (``analysis.backward_start``: only the nodes that
    depend on a tangent given are gradients there). Ordered as gradients instead, they ran where
    the full backward would run them: on the tiny HF Bamba the zero state tangent's
    ``select_backward`` ran before the slice it is added to, and its 655 kB were alive together
    with the 524 kB that slice frees, 210 kB above the predicted peak.
    """
    graph = bw.graph
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output = next(n for n in nodes if n.op == "output")
    tangent_dependent: set[fx.Node] = {
        p for p in placeholders if is_tangent(p) and p.name not in missing_tangents
    }
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
