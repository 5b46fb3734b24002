"""Under Inductor, a plan's kept values with fusible recomputation added, by torch's min-cut.

Why: Inductor fuses elementwise ops and reductions into the kernels that read them, so under
``executor="inductor"`` recomputing a BatchNorm's normalisation and the ReLU after it inside
the backward kernels that need them costs almost nothing, while keeping their outputs costs a
tensor each. ``torch.compile``'s min-cut partitioner is built on exactly that: with no
convolution recomputed, it keeps a CIFAR ResNet's step at 33.7 MiB where memfit's ``"none"``,
keeping what eager autograd keeps, held 62.8 MiB, at the same step time
(``docs/measurements.md``, "Speed: the Inductor executor on CPU"). memfit's own planners
decide which values to keep op by op, pricing each recomputation, but they do not know which
ops Inductor fuses; a plan's memory there came from recomputing convolutions instead.

Two kinds of candidate come from torch's solver. First, memfit's own plans with fusible
recomputation added, each side doing what it knows: memfit's plan decides what is recomputed
(every op it recomputes stays recomputed), and torch's min-cut solver (``_compat
.min_cut_saved_values``, the solve ``torch.compile`` runs under an ``activation_memory_budget``)
then chooses, among the rest, the fewest bytes to keep such that only ops Inductor fuses are
recomputed in addition. Random and impure ops stay kept. Second, the plans ``torch.compile``
itself makes under ``activation_memory_budget`` at a grid of budgets (its min-cut, then its
knapsack over which heavier ops to recompute): whatever ``torch.compile`` can reach, memfit
considers. Every candidate joins the frontier (``planning.frontier``), simulated and priced like
every other: the planner, not this module, decides which is worth it.

One departure from torch's solver, on CPU only: no candidate keeps a boolean mask (a comparison's
result, such as the ``x <= 0`` ReLU's backward reads) in place of the value compared. The min-cut
prefers the mask, a quarter of the bytes of the float32 value it tests, and memfit's cost model
called it free; measured on this project's CPU (torch 2.13, 2 threads,
``docs/measurements.md``), the step pays for it: a U-Net's budget plans keeping 1.84 M
mask elements (44.9 MiB) took 89-93 ms where the plans memfit takes instead, keeping the ReLU
outputs (47.2-50.2 MiB), took 81-82; at budget 0.4 the plan keeping 1.57 M took 99 ms at 39.4 MiB
where memfit's, keeping none, took 85 at 38.5. ``torch.compile``'s own default plan of a
transformer encoder, keeping 4.2 M, took 157 ms where its plan at budget 0.9, keeping none, took
116. On CUDA, where that was not measured, masks stay allowed as torch.compile allows them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import torch
import torch.fx as fx

from memfit._compat import min_cut_node_info, min_cut_saved_values_at
from memfit.analysis.cost import is_compute_heavy
from memfit.analysis.graph import JointGraph, node_tensors
from memfit.planning.keep_rules import always_kept
from memfit.planning.paused_gc import paused_gc

__all__ = [
    "COMPILE_BUDGETS",
    "fused_plan",
    "keeping_written",
    "slow_masks",
    "torch_compile_kept",
    "torch_compile_plans",
    "with_fused_recomputation",
]

#: The ``activation_memory_budget`` values whose ``torch.compile`` plans join the frontier.
COMPILE_BUDGETS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)

#: ``JointGraph.derived``'s key for torch's min-cut classification of the graph
#: (``_compat.min_cut_node_info``): every candidate of a graph is solved on one
_NODE_INFO = "min_cut_node_info"
#: ``JointGraph.derived``'s key for ``slow_masks``
_SLOW_MASKS = "slow_masks"


def with_fused_recomputation(jg: JointGraph, kept: set[fx.Node]) -> set[fx.Node]:
    """``kept`` less what Inductor can recompute inside the backward's fused kernels: the
    values min-cut keeps when everything ``kept`` recomputes must be recomputed."""
    (fused,) = _min_cut_kept(jg, [None], must_recompute=jg.recomputed_for(kept), may_keep=kept)
    return set(kept) if fused is None else fused


def fused_plan(jg: JointGraph, kept: set[fx.Node]) -> set[fx.Node]:
    """``kept`` made for Inductor: fusible recomputation added (``with_fused_recomputation``),
    then each value kept only to recompute what the forward writes anyway replaced by that
    (``keeping_written``)."""
    return keeping_written(jg, with_fused_recomputation(jg, kept))


def torch_compile_kept(jg: JointGraph, memory_budget: float) -> set[fx.Node]:
    """What ``torch.compile`` keeps of ``jg`` under ``activation_memory_budget=memory_budget``,
    with random and impure ops kept as memfit keeps them."""
    (kept,) = torch_compile_plans(jg, [memory_budget])
    return kept


def torch_compile_plans(jg: JointGraph, memory_budgets: Sequence[float]) -> list[set[fx.Node]]:
    """``torch_compile_kept`` at each of ``memory_budgets``, solved together: the min-cuts every
    budget shares are solved once (``_compat.min_cut_saved_values_at``)."""
    plans = _min_cut_kept(jg, list(memory_budgets))
    return [jg.saved_needed(always_kept(jg)) if kept is None else kept for kept in plans]


def keeping_written(jg: JointGraph, kept: AbstractSet[fx.Node]) -> set[fx.Node]:
    """``kept``, each value it keeps only to recompute one fusible op whose output Inductor writes
    to memory anyway replaced by that output: what the backward then reads.

    Why: a U-Net's plans kept a convolution's output and recomputed the ReLU after it, whose
    output the next convolution's backward reads. Inductor cannot fuse a value an external kernel
    (convolution, matrix product) reads: the backward wrote the ReLU's output to memory again,
    for the same bytes kept as keeping it (the forward writes it anyway, as that convolution's
    input). Keeping the ReLU's output instead keeps no more bytes (its size is at most the
    value's), recomputes less, and is what ``torch.compile``'s own plans keep. Measured on the
    frontier benchmark's U-Net (CPU, 2 threads, interleaved turns, 4 runs of 40-80 steps): the
    38.5 MiB plan of ``budget=0.4`` stepped in 0.96-0.985x the time, at the same peak.

    A value ``x`` moves to ``y`` when ``y`` is ``x``'s only user (in the forward and the
    backward alike), a fusible op (not a matrix product, convolution or attention, not random or
    impure, not a boolean mask on CPU: ``slow_masks``) that the backward recomputes, ``y``'s
    bytes are at most ``x``'s, no other kept value shares ``x``'s storage (a view), and the
    forward writes ``y`` anyway: a matrix product, convolution or attention reads it (through
    views), or it is a forward output. Then from ``y`` on, the plan holds ``y`` where it held
    ``x`` (``x`` dies once ``y`` is made, as nothing else reads it), at most as many bytes at
    every point of the step, so the peak cannot rise; repeated until nothing moves (a chain of
    such ops moves to its end).

    Several values kept only to recompute one ``y`` move to it together when ``y``'s bytes are
    at most theirs, written anyway or not: the ResNet's ``"speed"`` kept both convolutions a
    widening stage's first residual sum adds (the shortcut's and the block's) where
    ``torch.compile``'s plans keep the sum: 1.5 MiB more, and the two sums recomputed, in what
    was otherwise the same plan. The backward then reads one value where it read several, and
    the forward writes at most that one more.
    """
    kept = set(kept)
    forward = set(jg.forward)
    outputs = set(jg.fwd_outputs)
    masks = slow_masks(jg)
    while True:
        saved, recomputed = jg.needed_and_recomputed(kept)
        sharing: dict[Any, int] = {}
        for n in saved:
            for key in jg.storages.get(n, ()):
                sharing[key] = sharing.get(key, 0) + 1
        by_user: dict[fx.Node, list[fx.Node]] = {}  # the values kept only to recompute y
        for x in saved:
            if x.op == "placeholder" or x in outputs or jg.never_recompute(x) or len(x.users) != 1:
                continue
            (y,) = x.users
            x_storages = set(jg.storages.get(x, ()))
            if (
                all(sharing[key] == 1 for key in x_storages)  # no other kept view of it
                and not set(jg.storages.get(y, ())) & x_storages  # y is not a view of x
            ):
                by_user.setdefault(y, []).append(x)
        moves: dict[fx.Node, fx.Node] = {}
        for y, xs in by_user.items():
            if (
                y in recomputed
                and jg.is_tensor_value(y)
                and y not in masks
                and not is_compute_heavy(y)
                and not jg.never_recompute(y)
                and jg.bytes_of([y]) <= jg.bytes_of(xs)
                # several values for one: the backward reads one where it read several, which
                # pays for the forward writing it even where Inductor would not have
                and (len(xs) > 1 or _written(jg, y, forward, outputs))
            ):
                moves.update(dict.fromkeys(xs, y))
        if not moves:
            return saved
        kept = (saved - set(moves)) | set(moves.values())


def _written(jg: JointGraph, y: fx.Node, forward: set[fx.Node], outputs: set[fx.Node]) -> bool:
    """Whether Inductor writes forward value ``y`` to memory whatever a plan keeps: an external
    kernel (matrix product, convolution, attention) reads it, or a view of it, or it is a
    forward output."""
    storages = set(jg.storages.get(y, ()))
    stack, seen = [y], {y}
    while stack:
        n = stack.pop()
        if n in outputs:
            return True
        for u in n.users:
            if u not in forward or u in seen:
                continue
            if is_compute_heavy(u):
                return True
            if storages & set(jg.storages.get(u, ())):  # a view of y: follow it
                seen.add(u)
                stack.append(u)
    return False


def slow_masks(jg: JointGraph) -> set[fx.Node]:
    """The boolean values computed before ``jg``'s backward that no candidate keeps: on CPU,
    every one a plan could recompute (random and impure ops' are kept anyway, forward outputs
    are alive anyway); elsewhere none (see the module's docstring)."""
    return set(_derived(jg, _SLOW_MASKS, lambda: frozenset(_slow_masks(jg))))


def _slow_masks(jg: JointGraph) -> set[fx.Node]:
    # not only ``jg.forward``: a mask the forward's outputs do not need (ReLU's, read only by
    # its backward) is a value the backward reads that a plan may keep all the same
    values = [
        (n, node_tensors(n)) for n in jg.nodes if n.op == "call_function" and not jg.is_backward(n)
    ]
    if next((ts[0].device.type for _, ts in values if ts), None) != "cpu":
        return set()
    outputs = set(jg.fwd_outputs)
    return {
        n
        for n, ts in values
        if ts
        and all(t.dtype == torch.bool for t in ts)
        and not jg.never_recompute(n)
        and n not in outputs
    }


def _min_cut_kept(
    jg: JointGraph,
    memory_budgets: list[float | None],
    *,
    must_recompute: AbstractSet[fx.Node] = frozenset(),
    may_keep: AbstractSet[fx.Node] = frozenset(),
) -> list[set[fx.Node] | None]:
    """The kept set of torch's min-cut on ``jg`` at each of ``memory_budgets`` (None: the plain
    min-cut), random and impure values never recomputed, and no ``slow_masks`` kept but those in
    ``may_keep``, with what every plan keeps (None: the graph has no backward to partition
    for)."""
    node_info = _derived(
        jg,
        _NODE_INFO,
        lambda: min_cut_node_info(
            jg.module,
            num_fwd_outputs=jg.num_fwd_outputs,
            static_lifetime_input_indices=sorted(jg.static_inputs),
        ),
    )
    solved = min_cut_saved_values_at(
        jg.module,
        num_fwd_outputs=jg.num_fwd_outputs,
        static_lifetime_input_indices=sorted(jg.static_inputs),
        must_recompute=set(must_recompute) | (slow_masks(jg) - set(may_keep)),
        must_save={n for n in jg.forward if jg.never_recompute(n)},
        memory_budgets=memory_budgets,
        node_info=node_info,
        each_solve=paused_gc,  # each solve's networkx graph is cyclic garbage: collected there
    )
    always = always_kept(jg)
    return [jg.saved_needed(set(saved) | always) if saved else None for saved in solved]


def _derived(jg: JointGraph, key: str, compute: Callable[[], Any]) -> Any:
    """``jg.derived[key]``, computed by ``compute`` the first time it is asked for."""
    if key not in jg.derived:
        jg.derived[key] = compute()
    return jg.derived[key]
