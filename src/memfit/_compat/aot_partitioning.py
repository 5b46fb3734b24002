"""AOTAutograd's partitioning helpers: splitting a joint graph by a set of saved values, and
torch's own min-cut choice of saved values (for the Inductor executor's fusible candidates).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch.fx as fx
from torch._functorch import partitioners as _partitioners  # noqa: E402

from memfit._compat.autograd import _MISSING
from memfit._compat.symbolic_sizes import is_sym_node

__all__ = [
    "MIN_CUT_MAX_FLOW",
    "extract_fwd_bwd_modules",
    "min_cut_node_info",
    "min_cut_saved_values",
    "min_cut_saved_values_at",
]


def extract_fwd_bwd_modules(
    joint: fx.GraphModule,
    saved_values: list[fx.Node],
    *,
    num_fwd_outputs: int,
    static_lifetime_input_indices: Iterable[int] | None = None,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Split ``joint`` into forward and backward graphs that pass exactly ``saved_values``
    (tensors, and the sizes the backward reads where the graph has symbolic sizes).

    ``torch._functorch.partitioners._extract_fwd_bwd_modules`` (checked 2.13.0) is the function
    behind AOTAutograd's own partitioners: it knows the calling convention between the forward
    graph, the autograd.Function that runs it and the backward graph. ``static_lifetime_input
    _indices`` (parameters, buffers) is what AOTAutograd hands a partition function.
    """
    placeholders = [n for n in joint.graph.nodes if n.op == "placeholder"]
    static = _partitioners.OrderedSet(placeholders[i] for i in static_lifetime_input_indices or ())
    # Sizes (SymInts of a graph captured with dynamic shapes) travel apart from tensors: the
    # CompiledFunction stashes them on its ctx rather than in save_for_backward; the split keeps
    # only those the backward reads.
    tensors = [n for n in saved_values if not is_sym_node(n)]
    sizes = [n for n in saved_values if is_sym_node(n)]
    return _partitioners._extract_fwd_bwd_modules(
        joint,
        tensors,
        saved_sym_nodes=sizes,
        num_fwd_outputs=num_fwd_outputs,
        static_lifetime_input_nodes=static,
    )


def min_cut_saved_values(
    joint: fx.GraphModule,
    *,
    num_fwd_outputs: int,
    static_lifetime_input_indices: Iterable[int] | None,
    must_recompute: Iterable[fx.Node] = (),
    must_save: Iterable[fx.Node] = (),
    memory_budget: float | None = None,
) -> list[fx.Node]:
    """The values torch's min-cut partitioner saves in ``joint``, with ``must_recompute`` forced
    into the backward and ``must_save`` never recomputed.

    Without ``memory_budget``: ``torch._functorch.partitioners.solve_min_cut`` (checked 2.13.0),
    as ``torch.compile``'s own partitioner calls it under an ``activation_memory_budget`` below 1
    before its knapsack: ops Inductor fuses may be recomputed (its allowlist), compute-intensive
    and random ops are banned, and none of the three runtime heuristics (used far apart, long
    fusible chains, materialized in backward) bans anything. With ``memory_budget``: what
    ``torch.compile`` saves under ``activation_memory_budget=memory_budget``
    (``choose_saved_values_set``: its min-cut, then its knapsack over what else to recompute).
    ``node_info`` and ``dist_from_bw`` are built as ``min_cut_rematerialization_partition``
    builds them; the ``recompute`` tags are set only while it solves, and the graph is otherwise
    left as it was.
    """
    (saved,) = min_cut_saved_values_at(
        joint,
        num_fwd_outputs=num_fwd_outputs,
        static_lifetime_input_indices=static_lifetime_input_indices,
        must_recompute=must_recompute,
        must_save=must_save,
        memory_budgets=[memory_budget],
    )
    return saved


#: The networkx maximum-flow algorithm (``networkx.algorithms.flow``) torch's min-cut solves run
#: with inside ``min_cut_saved_values_at`` (torch calls ``networkx.minimum_cut`` with its
#: default, ``preflow_push``; checked 2.13.0, networkx 3.x). Why another: Boykov-Kolmogorov took
#: 7.9 s where preflow-push took 15.2 s for the 22 solves of a 14,212-node GPT-2's frontier, 0.53
#: against 0.89 s for a ResNet's 23 (CPU, 2 threads). The answer is the same: networkx cuts where
#: the residual network can no longer reach the sink, which is the same set of nodes for every
#: maximum flow (compared on all 58 solves of those and a 400-layer MLP; tests/test_fusion.py).
MIN_CUT_MAX_FLOW = "boykov_kolmogorov"


def min_cut_node_info(
    joint: fx.GraphModule,
    *,
    num_fwd_outputs: int,
    static_lifetime_input_indices: Iterable[int] | None,
) -> Any:
    """torch's classification of ``joint``'s nodes for its min-cut
    (``torch._functorch.partitioners.classify_nodes``, checked 2.13.0): which nodes the forward
    and the backward need, and the forward's order.

    Why apart: it reads only the graph's structure and AOTAutograd's partitioner tags, never the
    ``recompute`` tags a solve sets, yet it copies the forward graph (an FX graph, cyclic
    garbage afterwards) each time: 0.24 s for a 14,212-node GPT-2, whose Inductor frontier
    classified it 14 times. A caller solving one graph many times classifies it once; the answer
    holds while ``joint``'s graph is not changed.
    """
    return _partitioners.classify_nodes(
        joint, list(static_lifetime_input_indices or ()), num_fwd_outputs
    )


def min_cut_saved_values_at(
    joint: fx.GraphModule,
    *,
    num_fwd_outputs: int,
    static_lifetime_input_indices: Iterable[int] | None,
    memory_budgets: Sequence[float | None],
    must_recompute: Iterable[fx.Node] = (),
    must_save: Iterable[fx.Node] = (),
    node_info: Any = None,
    each_solve: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
) -> list[list[fx.Node]]:
    """``min_cut_saved_values`` at each of ``memory_budgets``, solved together.

    Why together: ``choose_saved_values_set`` solves the same three min-cuts for every budget
    (its default, "more aggressive" and "aggressive" options) and estimates the runtime of the
    same banned nodes before its knapsack; only the knapsack and the last min-cut depend on the
    budget. Ten budgets solved one by one took 38 min-cuts, 12.6 of a 100-layer MLP's 14.2 s
    frontier. Here the graph is classified once, and while the budgets are solved each min-cut
    (by its options and the nodes it may not ban) and each node's runtime estimate is computed
    once: the answers are the ones each budget gets on its own. Each min-cut's maximum flow is
    found by ``MIN_CUT_MAX_FLOW`` instead of networkx's default (see there). ``node_info``: what
    ``min_cut_node_info`` returned for ``joint`` (computed here if None); ``each_solve``: a
    context each min-cut solve runs in (``planning.paused_gc``'s, which collects the solve's
    networkx graph as it ends).
    """
    import torch._functorch.config as functorch_config
    from torch.utils.checkpoint import CheckpointPolicy

    graph = joint.graph
    if node_info is None:
        node_info = min_cut_node_info(
            joint,
            num_fwd_outputs=num_fwd_outputs,
            static_lifetime_input_indices=static_lifetime_input_indices,
        )
    if len(node_info.required_bw_nodes) == 0:  # nothing to partition (networkx would fail)
        return [[] for _ in memory_budgets]
    _set_distance_from_backward(graph, node_info)
    tags = {
        **{n: CheckpointPolicy.MUST_SAVE for n in must_save},
        **{n: CheckpointPolicy.MUST_RECOMPUTE for n in must_recompute},
    }
    options = _partitioners.MinCutOptions(
        ban_if_used_far_apart=False,
        ban_if_long_fusible_chains=False,
        ban_if_materialized_backward=False,
        ban_if_not_in_allowlist=functorch_config.ban_recompute_not_in_allowlist,
        ban_if_reduction=functorch_config.ban_recompute_reductions,
    )
    once = _SolvedOnce(each_solve)
    answers: list[list[fx.Node]] = []
    with _solving_once(once, tags):
        for budget in memory_budgets:
            if budget is None:
                saved, _ = once.solve_min_cut(graph, node_info, options)
            else:
                saved = _partitioners.choose_saved_values_set(graph, node_info, budget)
            answers.append(list(saved))
    return answers


def _set_distance_from_backward(graph: fx.Graph, node_info: Any) -> None:
    """How far each forward node is from the backward, as min_cut_rematerialization_partition
    computes it (an attribute the solver reads off every node)."""
    distance: dict[fx.Node, int] = {}
    for node in reversed(graph.nodes):
        if node.op != "output" and not node_info.is_required_fw(node):
            distance[node] = 0
        else:
            users = node.users if node.op != "output" else ()
            distance[node] = min([int(1e9)] + [distance[u] + 1 for u in users])
        setattr(node, "dist_from_bw", distance[node])  # noqa: B010


class _SolvedOnce:
    """torch's ``solve_min_cut`` and ``estimate_runtime``, each answer computed once (a min-cut
    by its options and the nodes it may not ban, a runtime by its node) while the budgets of one
    ``min_cut_saved_values_at`` are solved."""

    def __init__(self, each_solve: Callable[[], AbstractContextManager[Any]]) -> None:
        self.each_solve = each_solve
        #: torch's own functions, restored once the budgets are solved
        self.solve, self.estimate = _partitioners.solve_min_cut, _partitioners.estimate_runtime
        self.cuts: dict[tuple[Any, ...], tuple[list[fx.Node], Any]] = {}
        self.runtimes: dict[fx.Node, float] = {}

    def solve_min_cut(
        self, graph: fx.Graph, info: Any, cut_options: Any, dont_ban: Any = None
    ) -> tuple[list[fx.Node], Any]:
        key = (dataclasses.astuple(cut_options), frozenset(dont_ban or ()))
        if key not in self.cuts:
            with self.each_solve():
                self.cuts[key] = self.solve(graph, info, cut_options, dont_ban)
        saved, banned = self.cuts[key]
        return list(saved), type(banned)(banned)  # callers get their own lists

    def estimate_runtime(self, node: fx.Node) -> float:
        if node not in self.runtimes:
            self.runtimes[node] = self.estimate(node)
        return self.runtimes[node]


@contextlib.contextmanager
def _solving_once(once: _SolvedOnce, tags: dict[fx.Node, Any]) -> Iterator[None]:
    """Within: torch's partitioner solves through ``once``, networkx's minimum cut runs
    ``MIN_CUT_MAX_FLOW``, and ``tags`` are the nodes' ``recompute`` tags; all put back after."""
    import networkx
    from networkx.algorithms import flow

    minimum_cut = networkx.minimum_cut
    max_flow = getattr(flow, MIN_CUT_MAX_FLOW)

    def minimum_cut_with(graph: Any, source: Any, sink: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("flow_func", max_flow)
        return minimum_cut(graph, source, sink, **kwargs)

    previous = {n: n.meta.get("recompute", _MISSING) for n in tags}
    try:
        for n, tag in tags.items():
            n.meta["recompute"] = tag
        _partitioners.solve_min_cut = once.solve_min_cut  # type: ignore[assignment]
        _partitioners.estimate_runtime = once.estimate_runtime
        networkx.minimum_cut = minimum_cut_with
        yield
    finally:
        _partitioners.solve_min_cut, _partitioners.estimate_runtime = once.solve, once.estimate
        networkx.minimum_cut = minimum_cut
        for n, old in previous.items():
            if old is _MISSING:
                n.meta.pop("recompute", None)
            else:
                n.meta["recompute"] = old
