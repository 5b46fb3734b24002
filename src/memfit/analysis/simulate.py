"""Memory simulation of one training step: the bytes live after every op, forward then backward.

Why simulate instead of a formula: with recomputation, peak memory depends on *when* each value
is born and dies, not only on which values are kept. The simulator replays the exact orders the
executor will run (forward graph in joint order; backward graph in the autograd-like order of
``order_backward``) and frees each storage right after its last reader, as FX-generated code does
(``x = None`` after last use) and as AOTAutograd does for saved tensors once the backward graph
has consumed them. The same walker serves the planner's search (on the joint graph) and the final
prediction (on the very forward/backward graphs that run), so the two cannot drift apart.

Bytes are per storage (see ``analysis.graph``); storages of primals (parameters, buffers, user
inputs) existed before the step and are never counted, which makes the result directly comparable
with ``memfit.measure``'s "peak above entry".
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from memfit.analysis.backward_start import running_backward, start_of
from memfit.analysis.graph import JointGraph, ancestors, node_tensors
from memfit.analysis.transfers import Transfer

__all__ = ["Walk", "walk", "forward_order", "order_backward", "simulate_step", "StepSimulation"]

StorageFn = Callable[[fx.Node], Sequence[Any]]


@dataclass
class Walk:
    """Result of replaying one ordered list of nodes."""

    peak_bytes: int
    end_live: set[Any]
    end_bytes: int
    curve: list[int] = field(default_factory=list)
    #: storages alive when the peak was reached (``record_peak=True`` only)
    peak_live: frozenset[Any] = frozenset()


def walk(
    order: Sequence[fx.Node],
    storages: StorageFn,
    storage_bytes: dict[Any, int],
    *,
    start_live: Iterable[Any] = (),
    keep: Iterable[Any] = (),
    uncounted: Iterable[Any] = (),
    op_scratch: dict[fx.Node, int] | None = None,
    record_curve: bool = False,
    record_peak: bool = False,
    inputs: Callable[[fx.Node], Sequence[fx.Node]] | None = None,
) -> Walk:
    """Replay ``order``: allocate each node's new storages, free storages after their last use.

    ``start_live`` storages are alive at the start; ``keep`` storages are never freed during the
    walk; ``uncounted`` storages (parameters, inputs) exist but cost nothing; ``op_scratch`` is the
    scratch memory a node holds while it runs, on top of its inputs and outputs. ``record_peak``
    keeps the set of storages alive at the peak (a copy at every new peak: opt in).
    """
    scratch = op_scratch or {}
    uncounted_set = set(uncounted)
    keep_set = set(keep)
    inputs_of = inputs or (lambda n: n.all_input_nodes)
    last_use: dict[Any, int] = {}
    for i, n in enumerate(order):
        for key in storages(n):
            last_use[key] = i
        for a in inputs_of(n):
            for key in storages(a):
                last_use[key] = i
    frees: dict[int, list[Any]] = {}
    for key, i in last_use.items():
        if key not in keep_set and key not in uncounted_set:
            frees.setdefault(i, []).append(key)

    live = {k for k in start_live if k not in uncounted_set}
    current = sum(storage_bytes[k] for k in live)
    # Values alive at the start that nothing in this walk reads, and that nobody keeps, are gone
    # before the first op runs (AOTAutograd only hands over what the graph reads).
    for k in list(live):
        if k not in last_use and k not in keep_set:
            live.discard(k)
            current -= storage_bytes[k]
    peak = current
    peak_live = frozenset(live) if record_peak else frozenset()
    curve: list[int] = []
    for i, n in enumerate(order):
        for key in storages(n):
            if key not in live and key not in uncounted_set:
                live.add(key)
                current += storage_bytes[key]
        if current + scratch.get(n, 0) > peak:
            peak = current + scratch.get(n, 0)
            if record_peak:
                peak_live = frozenset(live)
        for key in frees.get(i, ()):
            if key in live:
                live.discard(key)
                current -= storage_bytes[key]
        if record_curve:
            curve.append(current)
    return Walk(peak_bytes=peak, end_live=live, end_bytes=current, curve=curve, peak_live=peak_live)


def _is_scalar(node: fx.Node) -> bool:
    """Whether ``node``'s value is one 0-dim tensor."""
    tensors = node_tensors(node)
    return len(tensors) == 1 and tensors[0].dim() == 0


def forward_order(jg: JointGraph, saved: Iterable[fx.Node]) -> list[fx.Node]:
    """Forward nodes that run: ancestors of the forward outputs and of the saved values."""
    needed = ancestors(list(jg.fwd_outputs) + list(saved), jg.inputs)
    return [n for n in jg.nodes if n in needed]


def order_backward(
    nodes: Sequence[fx.Node],
    is_backward: Callable[[fx.Node], bool],
    available: set[fx.Node],
    outputs: Sequence[fx.Node],
    inputs: Callable[[fx.Node], Sequence[fx.Node]] | None = None,
) -> list[fx.Node]:
    """Autograd-engine order: each backward node runs right after the recomputation it needs.

    ``nodes`` is the backward graph in its given (joint) order, where recomputed forward nodes
    all come first. Run naively, every recomputed value would be born at the start of backward
    and the recomputation would save nothing. Instead, walk the true backward nodes in order and
    pull in each one's missing ancestors just before it (in their original order), so a segment
    is recomputed when its gradients are about to be computed and freed right after.
    """
    inputs_of = inputs or (lambda n: n.all_input_nodes)
    position = {n: i for i, n in enumerate(nodes)}
    placed: set[fx.Node] = set(available)
    order: list[fx.Node] = []

    def place(target: fx.Node) -> None:
        pending: list[fx.Node] = []
        stack = [target]
        seen: set[fx.Node] = set()
        while stack:
            n = stack.pop()
            if n in placed or n in seen or n.op == "placeholder":
                continue
            seen.add(n)
            pending.append(n)
            stack.extend(inputs_of(n))
        pending.sort(key=lambda n: position.get(n, -1))
        for n in pending:
            placed.add(n)
            order.append(n)

    for n in nodes:
        if is_backward(n):
            place(n)
    for n in outputs:  # whatever feeds the outputs without touching a tangent
        place(n)
    return order


@dataclass
class StepSimulation:
    """Predicted memory of one forward+backward, bytes above what was live before the step."""

    peak_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    saved_bytes: int
    #: alive when the forward ends: what code between forward and backward runs on top of
    forward_end_bytes: int
    forward: list[fx.Node]
    backward: list[fx.Node]
    curve: list[int]
    #: storages alive at the step's peak (``record_peak=True`` only)
    peak_live: frozenset[Any] = frozenset()


class _Marker:
    """A step the executor adds around an offloaded value (its copy-out wait, its reload start).

    It sits in the simulated order like a node: the wait reads the value (so the value lives
    until it), the reload start allocates the value's device copy in backward.
    """

    __slots__ = ("reads", "creates")

    def __init__(self, reads: list[fx.Node], creates: list[Any]) -> None:
        self.reads = reads
        self.creates = creates


def _with_markers(
    order: list[fx.Node], markers: dict[fx.Node, list[_Marker]], after: bool
) -> list[Any]:
    out: list[Any] = []
    for n in order:
        if not after:
            out.extend(markers.get(n, ()))
        out.append(n)
        if after:
            out.extend(markers.get(n, ()))
    return out


def _running_graph(
    jg: JointGraph, view: Any
) -> tuple[
    list[fx.Node],
    Callable[[fx.Node], bool],
    Callable[[Any], Sequence[fx.Node]],
    Sequence[fx.Node],
    Callable[[Any], Sequence[Any]],
]:
    """``(nodes, is_backward, inputs, gradients, storages)`` of the joint graph that runs: ``jg``
    itself, or its backward specialized to the tangents that arrive as None (``view``)."""
    if view is None:
        nodes = [n for n in jg.nodes if n.op != "placeholder" and n.op != "output"]
        return (
            nodes,
            jg.is_backward,
            jg.inputs.__getitem__,
            jg.bwd_outputs,
            jg.storages.__getitem__,
        )
    made, known = view.storages, jg.storages

    def storages(n: Any) -> Sequence[Any]:
        return made[n] if n in made else known[n]

    return view.nodes, view.backward.__contains__, view.inputs.__getitem__, view.outputs, storages


def _storage_creators(jg: JointGraph) -> dict[Any, fx.Node]:
    """Each storage of ``jg`` to the first node whose value has it: the op that allocates it
    (views and getitems share their input's storage and come after it)."""
    creators: dict[Any, fx.Node] | None = jg.derived.get("storage_creators")
    if creators is None:
        creators = {}
        for n in jg.nodes:
            for key in jg.storages.get(n, ()):
                creators.setdefault(key, n)
        jg.derived["storage_creators"] = creators
    return creators


def _recomputed_anew(
    jg: JointGraph, bwd: Sequence[fx.Node], alive: set[Any]
) -> tuple[set[fx.Node], dict[Any, tuple[str, Any]]]:
    """The forward nodes ``bwd`` runs again, and a key of its own for each storage they allocate
    anew while the forward's storage is still ``alive`` at the backward's start.

    A recomputed op allocates a new tensor: it never writes into the storage its forward run
    made. That storage is usually gone by then, but a saved view of it keeps it (a kept
    ``getitem`` of a ``split`` whose input the plan recomputes: HF Mamba2's ``in_proj`` output
    on the tiny Bamba) until the saved view's last reader, while the recomputed copy lives from
    the recomputation to its own last reader. Counted as one storage, the two lifetimes merged:
    331,776 bytes held across the backward between them, 3.2% above the measured step.
    """
    creators = _storage_creators(jg)
    recomputed = {
        n for n in bwd if n in jg.index and n.op != "placeholder" and not jg.is_backward(n)
    }
    fresh: dict[Any, tuple[str, Any]] = {}
    for n in recomputed:
        for key in jg.storages.get(n, ()):
            if key in alive and creators.get(key) in recomputed:
                fresh[key] = ("recomputed", key)
    return recomputed, fresh


@dataclass
class _Passes:
    """What the forward and backward walks run over: the ops in order, with offloaded values'
    copy-out waits and prefetches as markers among them, and each run item's storages and
    inputs. ``moved``: the storages offloaded, not kept on the device between the passes."""

    fwd_run: list[Any]
    bwd_run: list[Any]
    fw_storages: Callable[[Any], Sequence[Any]]
    bw_storages: Callable[[Any], Sequence[Any]]
    fw_inputs: Callable[[Any], Sequence[fx.Node]]
    bw_inputs: Callable[[Any], Sequence[fx.Node]]
    storage_bytes: dict[Any, int]
    moved: set[Any]

    @classmethod
    def of(
        cls,
        jg: JointGraph,
        fwd: list[fx.Node],
        bwd: list[fx.Node],
        jg_storages: Callable[[Any], Sequence[Any]],
        joint_inputs: Callable[[Any], Sequence[fx.Node]],
        transfers: Sequence[Transfer],
    ) -> _Passes:
        if not transfers:
            return cls(
                list(fwd),
                list(bwd),
                jg.storages.__getitem__,
                jg_storages,
                jg.inputs.__getitem__,
                joint_inputs,
                jg.storage_bytes,
                set(),
            )
        # Each offloaded storage leaves the forward at its wait and comes back as a new storage
        # (the reload buffer) at its prefetch.
        storage_bytes = dict(jg.storage_bytes)
        moved: dict[Any, Any] = {}
        waits: dict[fx.Node, list[_Marker]] = {}
        starts: dict[fx.Node, list[_Marker]] = {}
        for t in transfers:
            (key,) = jg.storages[t.value]
            moved[key] = ("reloaded", key)
            storage_bytes[moved[key]] = storage_bytes[key]
            waits.setdefault(t.wait_after, []).append(_Marker([t.value], []))
            starts.setdefault(t.prefetch_before, []).append(_Marker([], [moved[key]]))
        placed = set(bwd)
        # a prefetch before an op the specialized backward does not run: at its start
        first = [m for n, ms in starts.items() if n not in placed for m in ms]

        def fw_storages(n: Any) -> Sequence[Any]:
            return n.creates if isinstance(n, _Marker) else jg.storages[n]

        def fw_inputs(n: Any) -> Sequence[fx.Node]:
            return n.reads if isinstance(n, _Marker) else jg.inputs[n]

        def bw_storages(n: Any) -> Sequence[Any]:
            if isinstance(n, _Marker):
                return n.creates
            return [moved.get(k, k) for k in jg_storages(n)]

        def bw_inputs(n: Any) -> Sequence[fx.Node]:
            return n.reads if isinstance(n, _Marker) else joint_inputs(n)

        return cls(
            _with_markers(fwd, waits, after=True),
            first + _with_markers(bwd, starts, after=False),
            fw_storages,
            bw_storages,
            fw_inputs,
            bw_inputs,
            storage_bytes,
            set(moved),
        )


def simulate_step(
    jg: JointGraph,
    saved: Iterable[fx.Node],
    *,
    transfers: Sequence[Transfer] = (),
    record_curve: bool = False,
    record_peak: bool = False,
) -> StepSimulation:
    """Simulate the step that keeps ``saved`` and recomputes everything else the backward needs.

    ``transfers`` are saved values offloaded (``analysis.transfers``): each stays on the device
    until its copy-out wait, and is back from its prefetch to its last backward reader.
    ``record_peak``: also say which storages are alive at the peak (``peak_live``).
    """
    saved_needed = jg.saved_needed(saved)
    fwd = forward_order(jg, saved_needed)
    start = start_of(jg)
    # The backward that runs: specialized to the tangents that arrive as None, if any
    # (``analysis.backward_start``).
    view = running_backward(jg)
    tangents = [t for t in jg.tangents if t.name not in start.missing]
    available = set(saved_needed) | set(jg.primals) | set(tangents)
    joint_nodes, is_backward, joint_inputs, grads, jg_storages = _running_graph(jg, view)
    bwd = order_backward(
        [n for n in joint_nodes if is_backward(n) or n not in available],
        is_backward,
        available,
        grads,
        joint_inputs,
    )
    primal_keys = jg.primal_keys
    out_keys = {k for n in jg.fwd_outputs for k in jg.storages[n]}
    saved_keys = {k for n in saved_needed for k in jg.storages[n]}
    # Outputs the caller no longer holds when the backward starts: gone then, unless the
    # backward reads them (then after their last reader).
    held_keys = {k for n in jg.fwd_outputs if n.name not in start.dropped for k in jg.storages[n]}
    dropped_keys = out_keys - held_keys - saved_keys
    recomputed, fresh = _recomputed_anew(jg, bwd, saved_keys | held_keys)
    if fresh:
        known_storages = jg_storages

        def jg_storages(n: Any) -> Sequence[Any]:
            keys = known_storages(n)
            return [fresh.get(k, k) for k in keys] if n in recomputed else keys

    passes = _Passes.of(jg, fwd, bwd, jg_storages, joint_inputs, transfers)
    if fresh:
        passes.storage_bytes = dict(passes.storage_bytes)
        passes.storage_bytes.update({new: passes.storage_bytes[k] for k, new in fresh.items()})
    saved_keys -= passes.moved
    # Both passes: the same storage sizes, uncounted inputs, op scratch and recording.
    walk_pass = functools.partial(
        walk,
        storage_bytes=passes.storage_bytes,
        uncounted=primal_keys,
        op_scratch=jg.op_scratch,
        record_curve=record_curve,
        record_peak=record_peak,
    )
    fw = walk_pass(
        passes.fwd_run, passes.fw_storages, keep=saved_keys | out_keys, inputs=passes.fw_inputs
    )
    tangent_keys = {k for t in tangents for k in jg.storages[t]}
    # A loss's gradient (a scalar tangent) is the one ``loss.backward()`` makes: the autograd
    # engine's graph root holds it to the end of the backward, whatever reads it last. Freed
    # after its last reader, it put a step 4 bytes above its prediction and a budget's measured
    # peak 4 bytes over the budget. Other tangents come from the nodes after the graph and go
    # when the graph's backward has read them (a 1 MiB one measured so).
    root_keys = {k for t in tangents if _is_scalar(t) for k in jg.storages[t]}
    grad_keys = {k for n in grads for k in jg_storages(n)}
    bw = walk_pass(
        passes.bwd_run,
        passes.bw_storages,
        start_live=(fw.end_live - dropped_keys) | tangent_keys,
        keep=held_keys | grad_keys | root_keys,
        inputs=passes.bw_inputs,
    )
    fresh_keys = set(fresh.values())
    # Between forward and backward the step runs code outside the graph (the loss, when the
    # model alone is captured) on top of everything the forward left alive.
    boundary = fw.end_bytes + jg.outside_bytes
    return StepSimulation(
        peak_bytes=max(fw.peak_bytes, bw.peak_bytes, boundary),
        forward_peak_bytes=fw.peak_bytes,
        backward_peak_bytes=bw.peak_bytes,
        forward_end_bytes=fw.end_bytes,
        saved_bytes=jg.bytes_of(saved_needed) - sum(t.nbytes for t in transfers),
        forward=fwd,
        # in ``jg``'s nodes (the zeros a specialized backward makes are not ``jg``'s)
        backward=bwd if view is None else [n for n in bwd if n not in view.storages],
        curve=fw.curve + bw.curve,
        # in ``jg``'s storages: a recomputed copy counts as the storage it copies
        peak_live=fw.peak_live
        if fw.peak_bytes >= bw.peak_bytes
        else frozenset(k[1] if k in fresh_keys else k for k in bw.peak_live),
    )
