"""A read-only view of an AOTAutograd joint graph: which nodes are forward, which are backward,
which storage each value lives in, how many bytes and FLOPs each node costs.

Why a view of our own: everything memfit decides (keep, recompute, predicted peak) is a question
about forward values and the backward nodes that read them. AOTAutograd hands the partition
function one joint graph with primals, tangents and both passes in it; the partition tags it
carries (``partitioner_tag``) differ across torch releases, so forward and backward are told apart
here by dataflow alone: a node is backward exactly when it depends on a tangent.

Memory is counted per *storage*, not per node: views (``t``, ``view``, ``expand``, ``getitem`` of a
multi-output op) share their base's storage, cost no bytes, and keep the base alive. The fake
tensors that tracing leaves in ``node.meta["val"]`` share fake storages exactly as real views
would, so the storage identity is read from them rather than from a table of view ops.

Sizes may be symbolic (a graph captured with dynamic shapes, ``analysis.sizes``): bytes are read at
the capture's hints, never guarded on, and ``at(sizes)`` gives the same view with every byte count
at other values of the symbols, for the simulator to replay a plan at a size that was not
captured. Values that are sizes themselves (``sym_size``, arithmetic on sizes) hold no storage
and are handed to the backward like inputs.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from memfit._compat import (
    StorageWeakRef,
    is_sym_node,
    is_tangent,
    op_schema,
    size_symbols,
    tree_flatten,
)
from memfit.analysis.sizes import HINTS, Sizes
from memfit.capture.batchnorm import FORWARD_TWIN
from memfit.capture.inplace_sums import INPLACE_OPERAND

__all__ = [
    "BackwardStart",
    "CUDA_BLOCK_BYTES",
    "JointGraph",
    "activation_device",
    "allocated_bytes",
    "ancestors",
    "is_random",
    "is_view_op",
    "node_tensors",
]


#: The CUDA caching allocator hands out blocks in multiples of 512 bytes (its smallest block), and
#: ``torch.cuda.memory_allocated`` (what ``memfit.measure`` reads on CUDA) counts the rounded
#: block: a graph of many small tensors keeps measurably more than their ``nbytes`` on CUDA.
CUDA_BLOCK_BYTES = 512


def allocated_bytes(nbytes: int, device: torch.device) -> int:
    """Bytes the allocator of ``device`` takes for a storage of ``nbytes``: exact on CPU, rounded
    up to :data:`CUDA_BLOCK_BYTES` on CUDA (an empty storage takes no block)."""
    if device.type != "cuda" or nbytes <= 0:
        return nbytes
    return -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES


def node_tensors(node: fx.Node) -> list[torch.Tensor]:
    """The tensors a node produces, from the fake values tracing recorded."""
    val = node.meta.get("val")
    if val is None:
        return []
    flat, _ = tree_flatten(val)
    return [t for t in flat if isinstance(t, torch.Tensor)]


def activation_device(jg: JointGraph) -> torch.device:
    """The device ``jg``'s activations are on: its first forward value's (the CPU if none)."""
    for n in jg.forward:
        for t in node_tensors(n):
            return t.device
    return torch.device("cpu")


def is_view_op(node: fx.Node) -> bool:
    """Whether ``node`` is an ATen op whose result aliases an input (a view such as ``t`` or
    ``view``, per its schema). False for Python glue without a schema (``getitem``)."""
    schema = op_schema(node.target)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def is_random(node: fx.Node) -> bool:
    """Random ops are never recomputed: a second draw would not give the same mask.

    An op is random when torch tags it ``nondeterministic_seeded``, except torch's fused
    attention kernels (``_DROPOUT_ONLY``) whose ``dropout_p`` is a constant 0. They carry the tag
    for their dropout, which draws nothing at p = 0: counted random, memfit kept every attention
    output of a dropout-free transformer and never measured the kernels' scratch (on an H200 the
    efficient backward's 128 KiB workspace made a step measure 1.6x its prediction). torch's own
    partitioner does not count them random either (its random ops are dropout and the
    ``rand_like`` family). A ``dropout_p`` that is not a constant number counts as dropout."""
    if node.op != "call_function":
        return False
    if torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    return not _draws_nothing(node)


#: torch's fused attention kernels, tagged ``nondeterministic_seeded`` for their dropout only:
#: at ``dropout_p`` 0 they leave the generator alone (CPU and CUDA, torch 2.13)
_DROPOUT_ONLY = frozenset(
    f"aten::{name}"
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_cudnn_attention_backward",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    )
)


def _draws_nothing(node: fx.Node) -> bool:
    """Whether a seeded op is one of ``_DROPOUT_ONLY`` with a constant ``dropout_p`` of 0."""
    schema = op_schema(node.target)
    if schema is None or schema.name not in _DROPOUT_ONLY:
        return False
    names = [a.name for a in schema.arguments]
    if "dropout_p" not in names:
        return False
    i = names.index("dropout_p")
    if "dropout_p" in node.kwargs:
        p = node.kwargs["dropout_p"]
    elif i < len(node.args):
        p = node.args[i]
    else:
        p = schema.arguments[i].default_value
    return isinstance(p, (int, float)) and not isinstance(p, bool) and p == 0


def _is_impure(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    try:
        return node.is_impure(impure_random=not _draws_nothing(node))
    except Exception:  # is_impure() cannot inspect every target: count it impure, to be safe
        return True


def ancestors(
    starts: Iterable[fx.Node], inputs: dict[fx.Node, list[fx.Node]] | None = None
) -> set[fx.Node]:
    """``starts`` and every non-placeholder node they depend on (``inputs``: a cache of edges)."""
    found: set[fx.Node] = set()
    stack = list(starts)
    while stack:
        n = stack.pop()
        if n in found or n.op == "placeholder":
            continue
        found.add(n)
        stack.extend(inputs[n] if inputs is not None else n.all_input_nodes)
    return found


@dataclass(frozen=True)
class BackwardStart:
    """One graph's backward start, by node names of its joint graph (stable across captures).

    Plain data that ``JointGraph`` carries; ``analysis.backward_start`` says where it comes from
    and derives it (assumed, or seen on a step)."""

    #: forward outputs the caller no longer holds when the backward starts (an output the
    #: backward also reads is then freed after its last reader)
    dropped: frozenset[str] = frozenset()
    #: tangents that arrive as None: outputs that get no gradient
    missing: frozenset[str] = frozenset()

    def describe(self) -> str:
        """One line for a plan's note, in the words of the step (how many of the model's outputs
        it dropped or did not differentiate), not the graph's node names."""
        parts = []
        if self.dropped:
            n = len(self.dropped)
            parts.append(
                f"{n} output{'s' if n > 1 else ''} of the model dropped before backward() "
                f"(freed as soon as the forward returns, e.g. logits the step does not keep)"
            )
        if self.missing:
            n = len(self.missing)
            parts.append(
                f"{n} output{'s' if n > 1 else ''} given no gradient (the backward does not "
                f"start from {'them' if n > 1 else 'it'})"
            )
        return "; ".join(parts) or "every output held through backward(), each with a gradient"


@dataclass
class JointGraph:
    """Forward/backward structure of one joint graph, computed once and shared by all planners."""

    module: fx.GraphModule
    num_fwd_outputs: int
    #: scratch bytes per node while it runs (``analysis.op_scratch``); empty: outputs only
    op_scratch: dict[fx.Node, int] = field(default_factory=dict)
    #: bytes the step holds outside this graph between its forward and its backward (a loss
    #: computed outside the model, measured on an earlier step), on top of what the forward
    #: leaves alive; 0: nothing known
    outside_bytes: int = 0
    #: positions among the primals of the step's parameters and buffers (AOTAutograd's static
    #: inputs): their gradients outlive the graph's backward (they become ``.grad``)
    static_inputs: frozenset[int] = frozenset()
    #: which outputs the caller still holds and which get a gradient when the backward starts
    #: (``analysis.backward_start``); None: every output held, every tangent given
    backward_start: BackwardStart | None = None
    #: the executor fuses elementwise ops and reductions into generated kernels (Inductor), so
    #: recomputing one costs its arithmetic, not its memory traffic (``analysis.cost``)
    fused_elementwise: bool = False
    #: what planners derive from the graph's structure alone, computed at first use and shared
    #: by every view ``at`` makes (torch's min-cut classification: ``planning.fusion``)
    derived: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)
    nodes: list[fx.Node] = field(init=False)
    index: dict[fx.Node, int] = field(init=False)
    primals: list[fx.Node] = field(init=False)
    tangents: list[fx.Node] = field(init=False)
    forward: list[fx.Node] = field(init=False)
    #: forward nodes the forward graph computes itself (``forward`` less BatchNorm twins)
    forward_computed: list[fx.Node] = field(init=False)
    backward: list[fx.Node] = field(init=False)
    fwd_outputs: list[fx.Node] = field(init=False)
    bwd_outputs: list[fx.Node] = field(init=False)
    storages: dict[fx.Node, list[Any]] = field(init=False)
    #: bytes of each storage at ``sizes`` (the capture's hints unless made by ``at``)
    storage_bytes: dict[Any, int] = field(init=False)
    #: each storage's size in bytes as captured: an int, or a SymInt where sizes are symbolic
    storage_sizes: dict[Any, Any] = field(init=False)
    #: the device each storage lives on (its allocator rounds sizes: :func:`allocated_bytes`)
    storage_devices: dict[Any, torch.device] = field(init=False)
    #: bytes a storage really holds beyond its fake size, at the hints, with the node that makes
    #: it (``hold_outputs``: a CPU ``mse_loss``'s 0-dim loss keeps its unreduced buffer)
    storage_surplus: dict[Any, tuple[fx.Node, int]] = field(init=False)
    #: the shape symbols the graph's sizes depend on (empty: static shapes)
    symbols: frozenset[Any] = field(init=False)
    #: the values ``storage_bytes`` and ``op_scratch`` are read at
    sizes: Sizes = field(init=False)
    #: each node's input nodes (``all_input_nodes`` is rebuilt on every access)
    inputs: dict[fx.Node, list[fx.Node]] = field(init=False)
    primal_keys: frozenset[Any] = field(init=False)
    _forward_set: set[fx.Node] = field(init=False, repr=False)
    _backward_set: set[fx.Node] = field(init=False, repr=False)
    #: each storage's identity (a ``StorageWeakRef`` of its fake storage) to its key
    _storage_ids: dict[Any, int] = field(init=False, repr=False)
    _must: set[fx.Node] = field(init=False, repr=False)
    _never: set[fx.Node] = field(init=False, repr=False)
    _size_values: set[fx.Node] = field(init=False, repr=False)
    _backward_reads: list[fx.Node] = field(init=False, repr=False)
    #: each forward view to the input it views (the same storage): see ``saved_needed``
    _view_sources: dict[fx.Node, fx.Node] = field(init=False, repr=False)
    _grads_by_primal: list[fx.Node | None] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        graph = self.module.graph
        self.nodes = list(graph.nodes)
        self.index = {n: i for i, n in enumerate(self.nodes)}
        placeholders = [n for n in self.nodes if n.op == "placeholder"]
        self.tangents = [n for n in placeholders if is_tangent(n)]
        self.primals = [n for n in placeholders if n not in set(self.tangents)]
        output = next(n for n in reversed(self.nodes) if n.op == "output")
        outs, _ = tree_flatten(output.args[0])
        outs_nodes = [o if isinstance(o, fx.Node) else None for o in outs]
        self.fwd_outputs = [o for o in outs_nodes[: self.num_fwd_outputs] if o is not None]
        self.bwd_outputs = [o for o in outs_nodes[self.num_fwd_outputs :] if o is not None]
        self._grads_by_primal = outs_nodes[self.num_fwd_outputs :]

        backward: set[fx.Node] = set(self.tangents)
        for n in self.nodes:
            if n.op == "call_function" and any(a in backward for a in n.all_input_nodes):
                backward.add(n)
        self.backward = [n for n in self.nodes if n in backward and n.op == "call_function"]
        self._backward_set = backward
        # Forward proper: what the forward outputs need. Nodes that read only forward values but
        # feed only the backward (``t(weight)`` for a linear's input gradient, ``detach`` of a
        # saved value) stay out: autograd computes them in backward, and so does memfit.
        # The one exception: items of a forward multi-output op (BatchNorm's saved mean and
        # inverse std) are part of that op's result, so they are forward values that can be kept;
        # leaving them out would make every plan re-run BatchNorm in backward to get them.
        required = ancestors(self.fwd_outputs)
        required |= {n for n in self.nodes if self.is_getitem(n) and n.args[0] in required}
        self.forward = [n for n in self.nodes if n in required]
        self._forward_set = required
        # A BatchNorm twin (``capture.batchnorm``) is a forward value, but the forward graph takes
        # it from the original op: it costs forward time only where the backward recomputes it.
        self.forward_computed = [n for n in self.forward if FORWARD_TWIN not in n.meta]

        # Storages are numbered once: every planner and simulator step hashes them, and an int
        # hashes far faster than a StorageWeakRef.
        self.storages = {}
        self.storage_sizes = {}
        self.storage_devices = {}
        ids: dict[Any, int] = {}
        for n in self.nodes:
            keys: list[Any] = []
            for t in node_tensors(n):
                try:
                    storage = t.untyped_storage()
                    ref: Any = StorageWeakRef(storage)
                    nbytes: Any = storage.nbytes()
                except (NotImplementedError, RuntimeError):
                    ref = (n, len(keys))
                    nbytes = t.numel() * t.element_size()
                key = ids.setdefault(ref, len(ids))
                if key not in self.storage_sizes:
                    self.storage_sizes[key] = nbytes
                    self.storage_devices[key] = t.device
                keys.append(key)
            self.storages[n] = keys
        # A gradient sum the eager executor makes in place lives in its operand's storage.
        for n in self.nodes:
            index = n.meta.get(INPLACE_OPERAND)
            if index is not None:
                self.storages[n] = list(self.storages[n.args[index]])
        self._storage_ids = ids
        self.storage_surplus = {}
        self.sizes = HINTS
        self.storage_bytes = self._bytes_at(HINTS)
        symbols: set[Any] = set()
        for v in self.storage_sizes.values():
            if isinstance(v, torch.SymInt):
                symbols |= size_symbols(v)
        self.symbols = frozenset(symbols)
        self.inputs = {n: n.all_input_nodes for n in self.nodes}
        self.primal_keys = frozenset(k for p in self.primals for k in self.storages[p])
        self._must = {n for n in self.nodes if is_random(n) or _is_impure(n)}
        self._never = {n for n in self.nodes if self._never_recompute(n)}
        self._size_values = {n for n in self.nodes if is_sym_node(n)}
        self._backward_reads = [
            a for n in self.backward for a in self.inputs[n] if a not in self._backward_set
        ]
        # Views of inputs are left out: one of a buffer the forward updates would be taken again
        # from the updated buffer (``bases_of_input_views`` in ``execution.split`` says more),
        # and their storage costs nothing here. Sizes that are graph values (symbolic shapes)
        # are handed to the backward with the value viewed (``_walk_back``).
        self._view_sources = {
            n: n.args[0]
            for n in self.forward
            if is_view_op(n)
            and isinstance(n.args[0], fx.Node)
            and n.args[0].op != "placeholder"
            and all(a is n.args[0] or a in self._size_values for a in self.inputs[n])
            and len(self.storages[n]) == 1
            and self.storages[n] == self.storages[n.args[0]]
        }

    def place_on(self, device: torch.device) -> None:
        """Count every storage as ``device``'s allocator takes it, whatever device the graph was
        traced on: a graph traced on CPU stand-ins for a device this machine does not have
        (``execution.fake_target``: the CUDA allocator's 512-byte blocks)."""
        self.storage_devices = dict.fromkeys(self.storage_devices, device)
        self.storage_bytes = self._bytes_at(self.sizes)

    def at(self, sizes: Sizes, op_scratch: dict[fx.Node, int] | None = None) -> JointGraph:
        """This view with every byte count at ``sizes`` (``op_scratch``: the ops' scratch there,
        by default the captured one scaled by ``scale_scratch``). Shares everything else."""
        other = copy.copy(self)
        other.sizes = sizes
        other.storage_bytes = self._bytes_at(sizes)
        other.op_scratch = op_scratch if op_scratch is not None else self.scale_scratch(sizes)
        return other

    def hold_outputs(self, outputs: dict[fx.Node, tuple[int, ...]]) -> None:
        """Count each storage ``outputs`` names at its real size: the bytes of each output
        tensor's storage (in ``node_tensors`` order) that running the node's op returned, where
        that is more than its fake tensor says (``analysis.op_scratch``'s NOTE [Outputs larger
        than their shape]). Storages of primals are not the graph's to count."""
        for n, real in outputs.items():
            for key, nbytes in zip(self.storages.get(n, ()), real):
                surplus = nbytes - HINTS(self.storage_sizes[key])
                if surplus > 0 and key not in self.primal_keys:
                    self.storage_surplus[key] = (n, surplus)
        self.storage_bytes = self._bytes_at(self.sizes)

    def _bytes_at(self, sizes: Sizes) -> dict[Any, int]:
        """Each storage's bytes at ``sizes``, as its device's allocator takes them."""
        return {
            k: allocated_bytes(sizes(v) + self._surplus_at(k, sizes), self.storage_devices[k])
            for k, v in self.storage_sizes.items()
        }

    def _surplus_at(self, key: Any, sizes: Sizes) -> int:
        made = self.storage_surplus.get(key)
        return 0 if made is None else self._scaled(made[0], made[1], sizes)

    def scale_scratch(self, sizes: Sizes) -> dict[fx.Node, int]:
        """The measured op scratch (at the hints) scaled to ``sizes`` by the bytes each op reads
        and writes: an estimate where an op's scratch grows with its tensors, as the workspaces of
        convolutions and matrix products do. Exact where shapes are static."""
        if not self.symbols or sizes is self.sizes:
            return self.op_scratch
        return {n: self._scaled(n, nbytes, sizes) for n, nbytes in self.op_scratch.items()}

    def _scaled(self, node: fx.Node, nbytes: int, sizes: Sizes) -> int:
        """``nbytes`` measured on ``node`` at the hints, scaled to ``sizes`` by the bytes the
        node reads and writes (its fake sizes)."""
        if not self.symbols or sizes is HINTS:
            return nbytes
        touched = [k for m in (node, *self.inputs[node]) for k in self.storages.get(m, ())]
        at_hint = sum(HINTS(self.storage_sizes[k]) for k in touched)
        there = sum(sizes(self.storage_sizes[k]) for k in touched)
        return round(nbytes * there / at_hint) if at_hint else nbytes

    # ---- facts about single nodes -------------------------------------------------------------

    def is_backward(self, node: fx.Node) -> bool:
        return node in self._backward_set

    @property
    def grads_by_primal(self) -> list[fx.Node | None]:
        """The gradient the backward returns for each primal, in order (None: it gets none)."""
        return list(self._grads_by_primal)

    def must_save(self, node: fx.Node) -> bool:
        """Forward nodes whose value must be kept rather than recomputed, whatever the policy."""
        return node in self._must

    def never_recompute(self, node: fx.Node) -> bool:
        """Values that are kept whatever a policy says: random and impure ops and their items."""
        return node in self._never

    def _never_recompute(self, node: fx.Node) -> bool:
        if self.is_getitem(node) and isinstance(node.args[0], fx.Node):
            return self.must_save(node.args[0])
        return self.is_tensor_value(node) and self.must_save(node)

    def is_tensor_value(self, node: fx.Node) -> bool:
        """A node whose own value is one tensor (multi-output nodes are saved through getitems)."""
        return isinstance(node.meta.get("val"), torch.Tensor)

    def allocated_by(self, node: fx.Node, seen: set[Any]) -> int:
        """Bytes of the storages ``node`` creates that are not in ``seen`` (which it updates)."""
        total = 0
        for key in self.storages.get(node, ()):
            if key not in seen:
                seen.add(key)
                total += self.storage_bytes[key]
        return total

    def own_bytes(self) -> dict[fx.Node, int]:
        """Bytes each forward node allocates when run in joint order (views and getitems: 0)."""
        seen: set[Any] = set()
        for p in self.primals:
            for key in self.storages.get(p, ()):
                seen.add(key)
        return {n: self.allocated_by(n, seen) for n in self.forward}

    def saved_needed(self, saved: Iterable[fx.Node]) -> set[fx.Node]:
        """The subset of ``saved`` the backward actually reads, directly or to recompute from.

        Walks up from every backward node through forward nodes that are not saved (they will be
        recomputed) and stops at saved nodes and primals; the primals it reaches are included,
        and so are random and impure values (``never_recompute``), whatever ``saved`` says.

        A view of a value that is saved too is not handed over again: the backward makes it from
        that value (no bytes, no FLOPs). Handed over as an input of its own, it pinned the same
        storage through a second reference, and a backward specialized to missing tangents
        (``analysis.backward_start``) that no longer reads it held it to its end: a Hugging Face
        Llama whose loss head memfit rewrites returns its logits as well, and the logits'
        backward, which never runs, read the head's input through such a view, so that
        ``[batch, seq, hidden]`` input outlived the loss head's backward (512 KiB at batch 4 of
        the tiny Llama, its measured step that much above the plan).
        """
        return self._walk_back(saved)[0]

    def recomputed_for(self, saved: Iterable[fx.Node]) -> set[fx.Node]:
        """The forward nodes the backward runs again when ``saved`` is kept: those it reaches
        from its reads without passing a saved value (``saved_needed``'s walk)."""
        return self.needed_and_recomputed(saved)[1]

    def needed_and_recomputed(self, saved: Iterable[fx.Node]) -> tuple[set[fx.Node], set[fx.Node]]:
        """``saved_needed(saved)`` and ``recomputed_for(saved)`` from one walk."""
        needed, visited = self._walk_back(saved)
        return needed, {n for n in visited - needed if n in self._forward_set}

    def _walk_back(self, saved: Iterable[fx.Node]) -> tuple[set[fx.Node], set[fx.Node]]:
        saved_set = set(saved)
        needed: set[fx.Node] = set()
        visited: set[fx.Node] = set()
        stack = list(self._backward_reads)
        never = self._never
        sizes = self._size_values
        inputs = self.inputs
        while stack:
            n = stack.pop()
            if n in visited:
                continue
            visited.add(n)
            if n in saved_set and self._view_sources.get(n) in saved_set:
                stack.extend(inputs[n])  # made again from the value it views (docstring)
                continue
            if n in saved_set or n.op == "placeholder" or n in never or n in sizes:
                needed.add(n)  # primals and sizes are handed to backward at no cost
                continue
            stack.extend(inputs[n])
        return needed, visited

    def parameter_grad_bytes(self) -> int:
        """Bytes of the gradients this graph's backward returns for its static inputs
        (parameters): unlike the gradients of its other inputs, they stay alive after it."""
        grads = [
            g
            for i, g in enumerate(self._grads_by_primal)
            if g is not None and i in self.static_inputs
        ]
        return self.bytes_of(grads)

    def bytes_of(self, nodes: Iterable[fx.Node], *, primals: bool = False) -> int:
        """Bytes of the distinct storages behind ``nodes``, primals' storages excluded unless
        ``primals`` (a graph's inputs: a chain's replay holds them, ``planning.plan_chain``)."""
        primal_keys = frozenset() if primals else self.primal_keys
        keys = {k for n in nodes for k in self.storages.get(n, ()) if k not in primal_keys}
        return sum(self.storage_bytes[k] for k in keys)

    def users_in_forward(self, node: fx.Node) -> list[fx.Node]:
        return [u for u in node.users if u in self._forward_set]

    @staticmethod
    def is_getitem(node: fx.Node) -> bool:
        return node.op == "call_function" and node.target is operator.getitem
