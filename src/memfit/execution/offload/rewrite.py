"""Putting a plan's transfers into the forward and backward graphs as the custom ops.

Part of ``memfit.execution.offload``: see its docstring.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from memfit.execution.offload import ops as _ops  # noqa: F401 - registers the ops inserted
from memfit.execution.offload.store import OffloadStore

#: ``node.meta`` key (set by ``execution.split``): the joint-graph name of a node that took
#: another's place in the forward graph.
JOINT_NAME = "memfit_joint_name"

__all__ = [
    "JOINT_NAME",
    "insert_transfers",
]


# ---- the graph rewrite -----------------------------------------------------------------------


def insert_transfers(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    transfers: list[tuple[str, str, str]],
    store: OffloadStore,
    *,
    num_fwd_outputs: int,
) -> None:
    """Put each ``(value, wait_after, prefetch_before)`` transfer into ``fw`` and ``bw``.

    ``fw`` returns the step's outputs then the values saved for backward, which ``bw`` receives as
    its leading placeholders in the same order; an offloaded value is swapped for its handle in
    both. Node names are the joint graph's, which the split keeps.
    """
    if not transfers:
        return
    fw_nodes = {n.name: n for n in fw.graph.nodes}
    # BatchNorm twins' items are replaced in the forward graph by items of the original op, which
    # remember the name the plan knows them by.
    fw_nodes.update({n.meta[JOINT_NAME]: n for n in fw.graph.nodes if JOINT_NAME in n.meta})
    fw_output = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
    outputs = list(fw_output.args[0])
    saved = outputs[num_fwd_outputs:]
    bw_placeholders = [n for n in bw.graph.nodes if n.op == "placeholder"]
    bw_nodes = {n.name: n for n in bw.graph.nodes}
    by_name = {n.name: n for n in bw_placeholders}
    fw_index = {n: i for i, n in enumerate(fw.graph.nodes)}  # the original nodes' order
    reloads = []
    for value_name, wait_after, prefetch_before in transfers:
        value = fw_nodes[value_name]
        position = next(i for i, s in enumerate(saved) if s is value)
        anchor = fw_nodes.get(wait_after, value)
        val = value.meta["val"]
        with _fake_mode_of(val):
            fake_handle = torch.empty((), dtype=torch.int64)
        saved[position] = _insert_offload(fw, value, anchor, fw_index, store, fake_handle)

        # The backward receives the saved value under its joint-graph name (by position only
        # if the split ever renamed it).
        placeholder = by_name.get(value_name, bw_placeholders[position])
        readers = list(placeholder.users)
        placeholder.meta["val"] = fake_handle
        if readers:
            reloads.append((placeholder, readers, bw_nodes.get(prefetch_before), val, fake_handle))
    _insert_reloads(bw, reloads, store)
    fw_output.args = (tuple(outputs[:num_fwd_outputs]) + tuple(saved),)
    for gm in (fw, bw):
        gm.graph.lint()
        gm.recompile()


def _insert_offload(
    fw: fx.GraphModule,
    value: fx.Node,
    anchor: fx.Node,
    fw_index: dict[fx.Node, int],
    store: OffloadStore,
    fake_handle: torch.Tensor,
) -> fx.Node:
    """The copy out of ``value``, started right after it, and its wait after ``anchor`` (the
    schedule's ``wait_after``, or the copy itself where that comes first): the wait's node, which
    the forward returns in ``value``'s place."""
    with fw.graph.inserting_after(value):
        handle = fw.graph.call_function(torch.ops.memfit.offload.default, (value, store.id))
    handle.meta["val"] = fake_handle
    after = anchor if fw_index[anchor] > fw_index[value] else handle
    with fw.graph.inserting_after(after):
        done = fw.graph.call_function(
            torch.ops.memfit.offload_wait.default, (value, handle, store.id)
        )
    done.meta["val"] = fake_handle
    return done


def _insert_reloads(bw: fx.GraphModule, reloads: list[Any], store: OffloadStore) -> None:
    """Each ``(placeholder, readers, prefetch, val, fake_handle)`` reload into ``bw``: its start
    before ``prefetch`` (or its first reader, where that comes first), its wait before the first
    reader, which with the other readers then reads the reloaded value."""
    # Reloads start in the order the schedule issues them: by prefetch node, then by first
    # reader (the one queue reads them one after another, as the simulator assumes).
    order = _order_in(bw.graph)
    issued = []
    for placeholder, readers, prefetch, val, fake_handle in reloads:
        first = min(readers, key=order)
        if prefetch is None or order(prefetch) > order(first):
            prefetch = first
        issued.append(
            (order(prefetch), order(first), placeholder, readers, prefetch, first, val, fake_handle)
        )
    issued.sort(key=lambda item: (item[0], item[1]))
    for _, _, placeholder, readers, prefetch, first, val, fake_handle in issued:
        with bw.graph.inserting_before(prefetch):
            token = bw.graph.call_function(
                torch.ops.memfit.reload_start.default, (placeholder, store.id)
            )
        token.meta["val"] = fake_handle
        with bw.graph.inserting_before(first):
            reloaded = bw.graph.call_function(
                torch.ops.memfit.reload_wait.default,
                (
                    placeholder,
                    token,
                    store.id,
                    list(val.shape),
                    list(val.stride()),
                    val.dtype,
                    val.device,
                ),
            )
        reloaded.meta["val"] = val
        for r in readers:
            r.replace_input_with(placeholder, reloaded)


def _fake_mode_of(val: torch.Tensor) -> Any:
    mode = getattr(val, "fake_mode", None)
    return contextlib.nullcontext() if mode is None else mode


def _order_in(graph: fx.Graph) -> Callable[[fx.Node], int]:
    index = {n: i for i, n in enumerate(graph.nodes)}
    return index.__getitem__
