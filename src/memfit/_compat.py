"""Every private PyTorch API memfit uses, reached through this one module.

memfit works inside ``torch.compile``: it plans on AOTAutograd's joint graph, splits it with
AOTAutograd's own partitioning helper, runs the result with FX's boxed calling convention and
measures CPU memory from the profiler's raw events. None of that has a public API. Private APIs
move between torch releases, so each one is reached here and nowhere else: when torch changes
one, this file is the only one to read, and each entry says what memfit needs it for and the
torch versions it was checked on. A test (``tests/test_compat.py``) calls every entry, so a
release that removes one fails there with the entry's name rather than deep inside a step.

Rule for the rest of the package: no ``import`` from ``torch._*``, ``torch.utils._*``,
``torch._C`` or ``functorch``; use the names below. Public torch APIs (``torch.compile``,
``torch.compiler.reset``, ``torch.profiler.profile``, ``torch.library``, ``torch.fx``) are used
directly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging as _logging
import sys
import unittest.mock
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from types import FrameType
from typing import Any

import torch
import torch.fx as fx

__all__ = [
    "CHECKED_TORCH_VERSIONS",
    "OpOverload",
    "TorchDispatchMode",
    "StorageWeakRef",
    "aot_autograd",
    "backward_keeps_graph",
    "own_donation",
    "boxed_codegen",
    "compiled_backward_ctx",
    "compiled_function_ctx",
    "eager_module_calls",
    "will_engine_accumulate",
    "accumulate_grad_nodes",
    "detect_fake_mode",
    "disable_current_modes",
    "extract_fwd_bwd_modules",
    "graph_break_reasons",
    "is_tangent",
    "keystr",
    "profiler_enabled",
    "profiler_events",
    "profiler_allocations",
    "profiler_started_anywhere",
    "cpu_memory_device_types",
    "tree_flatten",
    "tree_flatten_with_path",
    "tree_map",
    "tree_map_only",
    "tree_unflatten",
    "frames_converted",
    "unique_graph_count",
    "accumulated_recompile_limit",
    "compile_with_recompile_limit",
    "logging_functions",
    "traced_logging",
    "is_sym_node",
    "dense_memory_format",
    "size_hint",
    "size_expr",
    "size_symbols",
    # added for benchmarks
    "activation_memory_budget",
    "automatic_dynamic_shapes",
    "default_partition",
    "inductor_post_grad_pass",
    "make_boxed_func",
    # the Inductor executor
    "forward_output_strides",
    "inductor_compile",
    "inductor_schedule",
    "inductor_decompositions",
]

#: The torch releases every entry below was checked on (the test suite runs on these, and the
#: package requires at least the oldest).
CHECKED_TORCH_VERSIONS = ("2.13.0",)

if torch.__version__.split("+")[0] not in CHECKED_TORCH_VERSIONS:
    warnings.warn(
        f"memfit was checked on torch {', '.join(CHECKED_TORCH_VERSIONS)}, not on torch "
        f"{torch.__version__}: the private torch APIs in memfit._compat may have moved; "
        f"tests/test_compat.py checks each of them",
        stacklevel=2,
    )

# ---- pytrees: torch.utils._pytree (checked 2.13.0) ----------------------------------------------
# Flattening nested inputs and outputs the way Dynamo does. torch 2.13 has no public pytree module.
# ---- AOTAutograd and FX (checked 2.13.0) ---------------------------------------------------------
# aot_autograd: a Dynamo backend from forward/backward compilers and a partition function; it is
# how every torch.compile backend that wants a joint graph gets one.
from torch._dynamo.backends.common import aot_autograd  # noqa: E402
from torch._functorch import partitioners as _partitioners  # noqa: E402

# detect_fake_mode: the fake-tensor mode of a traced graph's values, to compute the metadata of a
# node memfit inserts (the BatchNorm split).
from torch._guards import detect_fake_mode  # noqa: E402

# OpOverload: the type of an ATen op in an FX graph (``aten.mm.default``).
from torch._ops import OpOverload  # noqa: E402
from torch.fx.graph import _BoxedCodeGen  # noqa: E402

# StorageWeakRef: a hashable identity of a (fake) storage, to count views of one storage once.
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402

# ---- dispatch modes and fake tensors (checked 2.13.0) --------------------------------------------
# TorchDispatchMode: attributing saved activations to the module that made them. Documented in
# "Extending PyTorch", but it lives in a private module.
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes  # noqa: E402
from torch.utils._pytree import (  # noqa: E402
    keystr,
    tree_flatten,
    tree_flatten_with_path,
    tree_map,
    tree_map_only,
    tree_unflatten,
)


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
    # How far each forward node is from the backward, as min_cut_rematerialization_partition
    # computes it (an attribute the solver reads off every node).
    distance: dict[fx.Node, int] = {}
    for node in reversed(graph.nodes):
        if node.op != "output" and not node_info.is_required_fw(node):
            distance[node] = 0
        else:
            users = node.users if node.op != "output" else ()
            distance[node] = min([int(1e9)] + [distance[u] + 1 for u in users])
        setattr(node, "dist_from_bw", distance[node])  # noqa: B010
    tags = {
        **{n: CheckpointPolicy.MUST_SAVE for n in must_save},
        **{n: CheckpointPolicy.MUST_RECOMPUTE for n in must_recompute},
    }
    previous = {n: n.meta.get("recompute", _MISSING) for n in tags}
    options = _partitioners.MinCutOptions(
        ban_if_used_far_apart=False,
        ban_if_long_fusible_chains=False,
        ban_if_materialized_backward=False,
        ban_if_not_in_allowlist=functorch_config.ban_recompute_not_in_allowlist,
        ban_if_reduction=functorch_config.ban_recompute_reductions,
    )
    solve, estimate = _partitioners.solve_min_cut, _partitioners.estimate_runtime
    import networkx
    from networkx.algorithms import flow

    minimum_cut = networkx.minimum_cut
    max_flow = getattr(flow, MIN_CUT_MAX_FLOW)

    def minimum_cut_with(graph: Any, source: Any, sink: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("flow_func", max_flow)
        return minimum_cut(graph, source, sink, **kwargs)

    cuts: dict[tuple[Any, ...], tuple[list[fx.Node], Any]] = {}
    runtimes: dict[fx.Node, float] = {}

    def solve_once(
        graph: fx.Graph, info: Any, cut_options: Any, dont_ban: Any = None
    ) -> tuple[list[fx.Node], Any]:
        key = (dataclasses.astuple(cut_options), frozenset(dont_ban or ()))
        if key not in cuts:
            with each_solve():
                cuts[key] = solve(graph, info, cut_options, dont_ban)
        saved, banned = cuts[key]
        return list(saved), type(banned)(banned)  # callers get their own lists

    def estimate_once(node: fx.Node) -> float:
        if node not in runtimes:
            runtimes[node] = estimate(node)
        return runtimes[node]

    answers: list[list[fx.Node]] = []
    try:
        for n, tag in tags.items():
            n.meta["recompute"] = tag
        _partitioners.solve_min_cut = solve_once  # type: ignore[assignment]
        _partitioners.estimate_runtime = estimate_once
        networkx.minimum_cut = minimum_cut_with
        for budget in memory_budgets:
            if budget is None:
                saved, _ = solve_once(graph, node_info, options)
            else:
                saved = _partitioners.choose_saved_values_set(graph, node_info, budget)
            answers.append(list(saved))
    finally:
        _partitioners.solve_min_cut, _partitioners.estimate_runtime = solve, estimate
        networkx.minimum_cut = minimum_cut
        for n, old in previous.items():
            if old is _MISSING:
                n.meta.pop("recompute", None)
            else:
                n.meta["recompute"] = old
    return answers


_MISSING = object()


def is_tangent(node: fx.Node) -> bool:
    """A joint graph's tangent input: AOTAutograd names them ``tangents_N`` (checked 2.13.0).

    The same test as ``torch._functorch.partitioners._is_tangent``.
    """
    return node.op == "placeholder" and "tangents" in str(node.target)


def compiled_function_ctx(frames: int = 3) -> Any:
    """The autograd ctx of the AOTAutograd ``CompiledFunction`` whose forward or backward calls
    the caller, searched for in ``frames`` frames above the caller's caller.

    A compiled forward is called as ``_compiled_fw_(list(args))`` from the code AOTAutograd
    generates for ``CompiledFunction.forward(ctx, ...)``, with the ctx in a local named ``ctx``;
    a compiled backward is called from ``CompiledFunction._backward_impl(ctx, ...)`` two frames
    further up (checked 2.13.0). There is no public way to reach it. The backward's ctx is the
    forward's (the autograd node), so the forward can leave the backward a note on it. None when
    the caller was not called so (an inference graph, or another torch release): callers must
    then work without it.
    """
    frame: FrameType | None = sys._getframe(2)  # 0: here, 1: the compiled graph, 2: its caller
    for _ in range(frames):
        if frame is None:
            return None
        # Reading f_locals copies a frame's locals into a dict: only where one is named ctx (an
        # argument or local, or a variable a closure shares: AOTAutograd's code has both).
        code = frame.f_code
        if "ctx" in code.co_varnames or "ctx" in code.co_cellvars or "ctx" in code.co_freevars:
            ctx = frame.f_locals.get("ctx")
            if _is_compiled_function_ctx(ctx):
                return ctx
        frame = frame.f_back
    return None


def _is_compiled_function_ctx(obj: Any) -> bool:
    """Whether ``obj`` is the ctx (autograd node) of an AOTAutograd ``CompiledFunction``."""
    forward_cls = getattr(type(obj), "_forward_cls", None)
    return forward_cls is not None and forward_cls.__name__ == "CompiledFunction"


def own_donation() -> None:
    """Tell AOTAutograd, while it compiles a forward graph, that its backward reuses none of the
    saved values AOTAutograd would count as donated.

    AOTAutograd (checked 2.13.0) finds, after the partition, the saved values nothing else holds
    (``fw_metadata.bw_donated_idxs``), and where there are any its backward refuses to run with
    ``retain_graph=True`` unless the first backward of that graph kept it too, since Inductor's
    backward may have written into them. memfit decides donation itself: the eager executor never
    donates, and a backward of the Inductor executor that keeps the graph runs a compile without
    donation (``execution.runners``). So memfit empties that list, on the metadata the tracing
    context holds (``aot_stage2b``'s ``tracing_context.fw_metadata``, set just before the forward
    compiler is called: the runtime's own metadata unless tensor subclasses are involved), and a
    backward keeping the graph runs at any step, as in plain PyTorch.
    """
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    if context is not None and context.fw_metadata is not None:
        context.fw_metadata.bw_donated_idxs = []


def backward_keeps_graph() -> bool:
    """Whether the backward running now keeps its graph for another pass (``retain_graph`` or
    ``create_graph``): ``torch._C._autograd._get_current_graph_task_keep_graph`` (checked
    2.13.0), what AOTAutograd asks before its backward may reuse donated buffers. True outside a
    backward."""
    return bool(torch._C._autograd._get_current_graph_task_keep_graph())


def compiled_backward_ctx() -> Any:
    """Inside the backward of an AOTAutograd ``CompiledFunction``: its ctx, the autograd node the
    engine is running (``torch._C._current_autograd_node``, what ``torch.autograd.graph`` asks,
    checked 2.13.0); None elsewhere (then ``compiled_function_ctx`` finds it on the stack).

    Every training step's backward asks: 2 us here, against 7 for the walk up five frames.
    Only a backward may ask: a forward recomputed inside a backward (a checkpoint) would get the
    node whose backward is running, not its own ctx.
    """
    node = torch._C._current_autograd_node()
    return node if _is_compiled_function_ctx(node) else None


def eager_module_calls() -> list[torch.nn.Module]:
    """The modules whose call is running eagerly on this thread's Python stack, innermost first.

    A module called from eager Python goes through ``nn.Module._call_impl``, a frame whose local
    ``self`` is the module (checked 2.13.0); a module call Dynamo traced into a graph leaves no
    such frame, and neither does one inside a running compiled graph. Asked from a
    ``torch.compile`` backend, while Dynamo converts a frame, the answer is the modules whose
    call Dynamo could not trace as part of its caller (a graph break inside it), with the module
    whose frame is being converted among them.
    """
    code = torch.nn.Module._call_impl.__code__
    found: list[torch.nn.Module] = []
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            module = frame.f_locals.get("self")
            if isinstance(module, torch.nn.Module):
                found.append(module)
        frame = frame.f_back
    return found


def will_engine_accumulate(leaf: torch.Tensor, node: Any = None) -> bool:
    """Whether the running backward accumulates into ``leaf.grad`` (its AccumulateGrad runs).

    ``torch._C._will_engine_execute_node`` (checked 2.13.0; it is what ``torch.utils.checkpoint``
    asks) says whether the current graph task executes a node: False for a leaf left out of
    ``backward(inputs=...)``, and it raises under ``torch.autograd.grad``, which captures a
    leaf's gradient instead of accumulating it. Only valid inside a backward. ``node``: the
    leaf's AccumulateGrad node where the caller has it (``accumulate_grad_nodes``); found with
    ``get_gradient_edge`` otherwise, which makes a view of the leaf to reach it (3.6-6.6 us).
    """
    if node is None:
        node = torch.autograd.graph.get_gradient_edge(leaf).node
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:
        return False


def accumulate_grad_nodes(node: Any) -> dict[int, Any]:
    """The AccumulateGrad nodes among autograd node ``node``'s next functions (the leaves its
    inputs came from), by ``id`` of their leaf (each node holds its leaf alive, so an id found
    here names that leaf while the caller holds it).

    An AccumulateGrad node holds its leaf as ``variable`` (checked 2.13.0), the tensor object
    itself. Reading them off the node of the running backward costs one pass over its edges,
    where ``get_gradient_edge`` makes a view per leaf.
    """
    found: dict[int, Any] = {}
    for next_node, _ in getattr(node, "next_functions", ()):
        leaf = getattr(next_node, "variable", None)
        if isinstance(leaf, torch.Tensor):
            found[id(leaf)] = next_node
    return found


def boxed_codegen() -> Any:
    """FX code generation for the boxed calling convention (``torch.fx.graph._BoxedCodeGen``).

    A boxed graph takes its inputs as one list and clears it as it unpacks it, so each input (a
    saved tensor, in a backward graph) can be freed after its last use (checked 2.13.0).
    """
    return _BoxedCodeGen()


# ---- Dynamo's counters: torch._dynamo.utils.counters (checked 2.13.0) ----------------------------
def graph_break_reasons() -> dict[str, int]:
    """How often Dynamo recorded each graph-break reason so far in this process.

    Dynamo counts them under two keys of ``torch._dynamo.utils.counters`` (checked 2.13.0):
    ``graph_break`` (an untraceable call, such as ``print``) and ``unimplemented`` (data-dependent
    control flow, such as an ``if`` on a tensor's value).
    """
    from torch._dynamo.utils import counters

    out: dict[str, int] = {}
    for key in ("graph_break", "unimplemented"):
        for reason, count in counters.get(key, {}).items():
            out[reason] = out.get(reason, 0) + count
    return out


def frames_converted() -> tuple[object, int]:
    """A token that changes whenever Dynamo has tried to convert a frame since it was taken.

    Dynamo records graph-break reasons only while it converts a frame, and counts every frame it
    tries to convert under ``counters["frames"]["total"]`` (``ConvertFrame.__call__``, checked
    2.13.0): while that count stands, no reason was added. The token holds the counter object
    too, so clearing the counters (``counters.clear()``, as Dynamo's own test cases do; a
    ``torch._dynamo.reset`` keeps them) never reads as "unchanged".
    Reading it is two dictionary lookups, where ``graph_break_reasons`` walks every reason.
    """
    global _COUNTERS
    if _COUNTERS is None:  # imported once: an import statement costs a microsecond a call
        from torch._dynamo.utils import counters

        _COUNTERS = counters
    frames = _COUNTERS["frames"]
    return frames, frames["total"]


_COUNTERS: Any = None  # torch._dynamo.utils.counters, once frames_converted first reads it


def unique_graph_count() -> int:
    """Graphs Dynamo has compiled in this process: a change means something was recompiled."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_with_recompile_limit(
    fn: Callable[..., Any], *, backend: Any, dynamic: bool | None, limit: int
) -> Callable[..., Any]:
    """``torch.compile(fn, backend=..., dynamic=..., recompile_limit=limit)``.

    ``recompile_limit`` (documented in ``torch.compile``'s docstring, checked 2.13.0) lifts
    Dynamo's per-code-object limit (``torch._dynamo.config.recompile_limit``, 8) for the frames
    this compile converts only; ``torch.compile``'s typed overloads do not list it yet, hence the
    call through ``Any``.
    """
    compile_: Any = torch.compile
    return compile_(fn, backend=backend, dynamic=dynamic, recompile_limit=limit)


def accumulated_recompile_limit(limit: int) -> AbstractContextManager[Any]:
    """Dynamo's process-wide cap on compiled variants of one code object
    (``torch._dynamo.config.accumulated_recompile_limit``, 256) raised to at least ``limit`` while
    the context is open, and restored on exit (``_RaisedRecompileLimit``).

    Every ``torch.compile``d module enters through one shared code object
    (``torch/_dynamo/external_utils.py``'s ``inner``), and this cap counts its variants across
    every ``torch.compile`` call in the process: after 256 memfit wrappers' captures, new ones ran
    eagerly without a plan (measured: 44 of 300 one-capture wrappers). The per-code limit (8)
    is lifted for memfit's calls by ``torch.compile(recompile_limit=...)`` instead, which applies
    to those calls only; this cap has no such parameter (checked 2.13.0). memfit counts shapes
    per wrapper itself and opens this around its own calls only. Those run eagerly, excluded from
    any outer ``torch.compile`` (``PlannedCall.__call__``), so this is never traced.
    """
    return _RaisedRecompileLimit(limit)


import torch._dynamo.config as _dynamo_config  # noqa: E402
import torch.utils._config_module as _config_module  # noqa: E402

#: Where Dynamo's config module keeps ``accumulated_recompile_limit``'s value (checked 2.13.0):
#: an entry whose ``user_override`` is a ``ContextVar``, which ``__setattr__`` sets before marking
#: the module's cached dicts dirty. None on a torch laid out otherwise (then plain attributes).
_LIMIT_NAME = "accumulated_recompile_limit"
_LIMIT_ENTRY: Any = getattr(_dynamo_config, "_config", {}).get(_LIMIT_NAME)
_UNSET: Any = getattr(_config_module, "_UNSET_SENTINEL", None)
if _UNSET is None or not all(
    hasattr(x, attr)
    for x, attr in (
        (_LIMIT_ENTRY, "user_override"),
        (_LIMIT_ENTRY, "env_value_force"),
        (_LIMIT_ENTRY, "env_value_default"),
        (_LIMIT_ENTRY, "default"),
        (_dynamo_config, "_hash_dirty_var"),
        (_dynamo_config, "_mark_get_dict_dirty"),
    )
):
    _LIMIT_ENTRY = None


def _recompile_limit_now() -> int:
    """``accumulated_recompile_limit`` as the config module's ``__getattr__`` reads it (an
    environment's forced value, the user's, the environment's default, the default: checked
    2.13.0), without its deprecation and alias checks: every training step reads it."""
    entry = _LIMIT_ENTRY
    for value in (entry.env_value_force, entry.user_override.get(), entry.env_value_default):
        if value is not _UNSET:
            return int(value)
    return int(entry.default)


class _RaisedRecompileLimit:
    """Dynamo's ``accumulated_recompile_limit`` raised to at least ``limit`` while the context is
    open, and restored on exit.

    Every training step opens one, so it is cheap: it sets the config entry's ``ContextVar`` as
    ``__setattr__`` does (and marks the same caches dirty), and on exit resets it with the token,
    which restores the value exactly, unset included. Through the module's ``__setattr__``, read
    and written back, the context took 36-46 us of a step inside real steps (about 8.6 us in a
    tight loop, against 0.7 for the entry's own ``set``/``reset``), the largest part of memfit's
    130 us per step above ``torch.compile``'s on a tiny encoder (CPU, 2026-11-27).
    """

    __slots__ = ("limit", "token", "saved")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.token: Any = None
        self.saved: int | None = None

    def __enter__(self) -> None:
        if self.token is not None or self.saved is not None:
            raise RuntimeError("accumulated_recompile_limit is not reentrant: open a new one")
        if _LIMIT_ENTRY is None:
            current = _dynamo_config.accumulated_recompile_limit
            if current < self.limit:
                self.saved = current
                _dynamo_config.accumulated_recompile_limit = self.limit
            return
        if _recompile_limit_now() >= self.limit:
            return
        self.token = _LIMIT_ENTRY.user_override.set(self.limit)
        _changed()

    def __exit__(self, *exc: object) -> None:
        if self.token is not None:
            _LIMIT_ENTRY.user_override.reset(self.token)
            self.token = None
            _changed()
        elif self.saved is not None:
            _dynamo_config.accumulated_recompile_limit = self.saved
            self.saved = None


def _changed(*names: str) -> None:
    """What Dynamo's config ``__setattr__`` does after setting a value (checked 2.13.0), for the
    entries ``names`` (by default ``accumulated_recompile_limit``)."""
    config: Any = _dynamo_config
    config._hash_dirty_var.set(True)
    for name in names or (_LIMIT_NAME,):
        config._mark_get_dict_dirty(name)


# ---- logging inside a captured forward: Dynamo's logging config (checked 2.13.0) -----------------
# NOTE [logging without graph breaks]
# Dynamo cannot trace a logging call, so each one inside a forward breaks the graph: HF GPT-2's
# loss calls ``logger.warning_once`` every step (first step 9.0 s instead of 6.0 s). Dynamo has
# two documented knobs for this (``torch/_dynamo/config.py``, checked 2.13.0):
# - ``reorderable_logging_functions`` (public as ``torch.compiler.config``'s): a plain or builtin
#   function in the set is not traced but called again after the graph, with the same arguments,
#   so the user still sees it. Only arguments that are tensors, constants or string formats can
#   be replayed; any other (a warning category: ``warnings.warn(msg, FutureWarning)``) still
#   breaks the graph, as without the knob. And only a call in the frame Dynamo compiles is
#   replayed (the forward ``memfit.checkpoint`` compiles, the function ``memfit.step`` compiles):
#   one in a function Dynamo inlines into it (a submodule's forward, a helper) is dropped, because
#   each inlined frame records its calls in its own ``debug_locals``, which nothing replays
#   (``InliningInstructionTranslator``; ``output_graph.py``: "TODO get debug_locals working for
#   nested graph breaks"). Used for ``warnings.warn`` and the ``logging`` module's functions
#   (``logging.warning(...)``), as ``torch.export`` does by default.
# - ``ignore_logging_functions`` (``ignore_logger_methods`` before): a no-op instead. It is the only
#   knob a ``logging.Logger`` method obeys (``LoggingLoggerVariable.call_method`` reads no other),
#   so ``logger.warning(...)`` in a compiled forward is not emitted: the price of one graph. Used
#   for ``logging.Logger``'s methods up to warnings (``debug``, ``info``, ``warning``, ``warn``:
#   an error, ``exception`` or ``critical`` message is never silenced, it breaks the graph as
#   before, and ``log`` may be any of them) and the ones ``transformers.utils.logging`` (and
#   ``diffusers``'s copy of it) adds to ``logging.Logger`` when imported (``warning_once``,
#   ``info_once``: ``functools.lru_cache`` wrappers, matched as a bound method's ``__func__``;
#   ``warning_advice``). Those are read off ``logging.Logger`` at each call, so nothing imports
#   transformers, and a later import is covered from the next call on.
# memfit adds these for its own compiles only (``traced_logging``, around each call): a user's
# other ``torch.compile`` calls keep their config. Neither set is part of any compile cache key.

#: The ``logging`` module's functions replayed after the graph. ``logging.exception`` is not one:
#: replayed after the graph it is outside its ``except`` block and logs no traceback.
_REORDERED_LOGGING: frozenset[Callable[..., Any]] = frozenset(
    {
        warnings.warn,
        _logging.debug,
        _logging.info,
        _logging.warning,
        _logging.error,
        _logging.critical,
        _logging.log,
    }
)
#: Methods of ``logging.Logger`` skipped in a compiled forward: messages up to warnings only.
_LOGGER_METHODS = ("debug", "info", "warning", "warn")
#: The ones ``transformers.utils.logging`` sets on ``logging.Logger`` (read at each call).
_ADDED_LOGGER_METHODS = ("warning_once", "info_once", "warning_advice")
_LOGGER_FUNCTIONS = frozenset(
    f for n in _LOGGER_METHODS if (f := getattr(_logging.Logger, n, None)) is not None
)
_ignored_cache: tuple[tuple[Any, ...], frozenset[Callable[..., Any]]] = ((), _LOGGER_FUNCTIONS)
_REORDER_NAME = "reorderable_logging_functions"
_IGNORE_NAME = "ignore_logging_functions"
#: The two entries' ``_ConfigEntry`` (checked 2.13.0), set through their ``ContextVar`` as for
#: ``_LIMIT_ENTRY`` (None where that is: a torch laid out otherwise).
_LOGGING_ENTRIES: Any = tuple(
    getattr(_dynamo_config, "_config", {}).get(name) for name in (_REORDER_NAME, _IGNORE_NAME)
)
if _LIMIT_ENTRY is None or not all(
    e is not None and hasattr(e, "user_override") and isinstance(e.default, set)
    for e in _LOGGING_ENTRIES
):
    _LOGGING_ENTRIES = None


def logging_functions() -> tuple[frozenset[Callable[..., Any]], frozenset[Callable[..., Any]]]:
    """(replayed after the graph, ignored): the callables ``traced_logging`` adds to Dynamo's
    ``reorderable_logging_functions`` and ``ignore_logging_functions`` (checked 2.13.0)."""
    global _ignored_cache
    methods = _logging.Logger.__dict__
    added = tuple(methods.get(n) for n in _ADDED_LOGGER_METHODS)
    if added != _ignored_cache[0]:
        ignored = _LOGGER_FUNCTIONS | {f for f in added if f is not None}
        _ignored_cache = (added, ignored)
    return _REORDERED_LOGGING, _ignored_cache[1]


def traced_logging() -> AbstractContextManager[Any]:
    """Dynamo traces through logging and ``warnings.warn`` calls while the context is open,
    without a graph break (NOTE [logging without graph breaks]); the config is restored on exit.

    Every training step opens one, so, like ``accumulated_recompile_limit``, it sets the config
    entries' ``ContextVar`` and resets it with the token: 5-7 us, where
    ``torch._dynamo.config.patch`` took 22 (a loaded 2-core CPU, 2026-11-28). Functions the
    user's config already lists stay as they are (a user's own ``ignore_logging_functions`` entry
    is not turned into a replay).
    """
    return _TracedLogging()


class _TracedLogging:
    """``traced_logging``: each set extended with memfit's entries, on the user's current one."""

    __slots__ = ("tokens", "patch")

    def __init__(self) -> None:
        self.tokens: list[tuple[Any, Any, str]] = []
        self.patch: Any = None

    def __enter__(self) -> None:
        if self.tokens or self.patch is not None:
            raise RuntimeError("traced_logging is not reentrant: open a new one")
        reordered, ignored = logging_functions()
        entries = _LOGGING_ENTRIES
        if entries is None:  # a torch laid out otherwise: read the attributes, patch them
            user_reordered = getattr(_dynamo_config, _REORDER_NAME)
            user_ignored = getattr(_dynamo_config, _IGNORE_NAME)
        else:
            user_reordered = _config_value_now(entries[0])
            user_ignored = _config_value_now(entries[1])
        wanted = (
            (0, _REORDER_NAME, reordered - user_ignored, user_reordered),
            (1, _IGNORE_NAME, ignored - user_reordered, user_ignored),
        )
        patch = {name: current | ours for _, name, ours, current in wanted if not ours <= current}
        if entries is None:
            self.patch = _dynamo_config.patch(patch)
            self.patch.__enter__()
            return
        for i, name, _, _ in wanted:
            if name in patch:
                self.tokens.append((entries[i], entries[i].user_override.set(patch[name]), name))
        if self.tokens:
            _changed(*patch)

    def __exit__(self, *exc: object) -> None:
        if self.patch is not None:
            self.patch.__exit__(*exc)
            self.patch = None
        if self.tokens:
            for entry, token, _ in reversed(self.tokens):
                entry.user_override.reset(token)
            _changed(*(name for _, _, name in self.tokens))
            self.tokens.clear()


def _config_value_now(entry: Any) -> Any:
    """A config entry's value as the config module's ``__getattr__`` reads it, without copying
    a mutable default into the entry as that does (checked 2.13.0)."""
    for value in (entry.env_value_force, entry.user_override.get(), entry.env_value_default):
        if value is not _UNSET:
            return value
    return entry.default


# ---- symbolic sizes (checked 2.13.0) -------------------------------------------------------------
# A graph captured with dynamic shapes carries SymInts (a sympy expression over the shape
# environment's symbols, with a hint: the value at capture) wherever a size varies. Reading one as
# ``int(...)`` asks the shape environment to *guard* on its value, which specializes the graph to
# that size; memfit's estimates (bytes, FLOPs) must read hints instead, and its per-size
# predictions substitute sizes into the expressions. ``torch.fx.experimental.symbolic_shapes``
# is where torch keeps these helpers; it is not underscored but documented as experimental.
from torch.fx.experimental.symbolic_shapes import free_symbols as _free_symbols  # noqa: E402
from torch.fx.experimental.symbolic_shapes import optimization_hint as _optimization_hint  # noqa: E402


def size_hint(value: Any) -> int:
    """``value`` (an int or SymInt) at the sizes it was captured with, adding no guard.

    ``optimization_hint`` is torch's own "for memory estimation" reading of a size (checked
    2.13.0); a plain ``int(symint)`` would guard on the value and specialize the graph.
    """
    if isinstance(value, torch.SymInt):
        return int(_optimization_hint(value))
    return int(value)


def size_expr(value: Any) -> Any:
    """The sympy expression behind a SymInt (``value.node.expr``), or the int itself."""
    if isinstance(value, torch.SymInt):
        return value.node.expr
    return int(value)


def size_symbols(value: Any) -> set[Any]:
    """The shape symbols a value (SymInt, tensor, or a nest of them) depends on."""
    return set(_free_symbols(value))


def is_sym_node(node: fx.Node) -> bool:
    """A node whose value is a symbolic int, float or bool (a size computed in the graph)."""
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))


#: Dense layouts a tensor can have by name, tried in this order: a tensor with a size-1 dimension
#: can be several at once, and eager's default comes first.
_DENSE_FORMATS = (torch.contiguous_format, torch.channels_last, torch.channels_last_3d)


def dense_memory_format(value: torch.Tensor) -> torch.memory_format | None:
    """The memory format ``value``'s strides are (contiguous, channels-last), or None if none.

    ``torch._prims_common.is_contiguous_for_memory_format_or_false`` (checked 2.13.0): it answers
    False rather than guard where a stride holds a size symbol.
    """
    from torch._prims_common import is_contiguous_for_memory_format_or_false

    for memory_format in _DENSE_FORMATS:
        if is_contiguous_for_memory_format_or_false(value, memory_format=memory_format):
            return memory_format
    return None


# ---- the profiler's raw events (checked 2.13.0) --------------------------------------------------
def profiler_enabled() -> bool:
    """Whether any torch profiler session is active on this thread (``torch._C._autograd``)."""
    return bool(torch._C._autograd._profiler_enabled())


def profiler_events(prof: torch.profiler.profile) -> list[Any]:
    """The raw events of a finished session (``prof.profiler.kineto_results.events()``).

    Unlike ``key_averages()`` they keep each allocation's signed size (``nbytes()``) and start
    time (``start_ns()``), which a peak needs.
    """
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    return list(results.events()) if results is not None else []


def cpu_memory_device_types() -> set[Any]:
    """Device types of ``[memory]`` events that are CPU allocator memory (CPU, MKLDNN, IDEEP)."""
    device_type = torch._C._autograd.DeviceType
    return {getattr(device_type, n) for n in ("CPU", "MKLDNN", "IDEEP") if hasattr(device_type, n)}


def profiler_allocations(prof: torch.profiler.profile) -> list[tuple[int, int, int]] | None:
    """``(start_ns, signed bytes, address)`` of every CPU allocator event, or None if unknown.

    ``kineto_results.experimental_event_tree()`` carries the block address, which the flat events
    do not; it costs a walk over every event (checked 2.13.0).
    """
    try:
        from torch._C._profiler import _EventType

        results = prof.profiler.kineto_results if prof.profiler is not None else None
        if results is None:
            return None
        out = []
        stack = list(results.experimental_event_tree())
        while stack:
            ev = stack.pop()
            stack.extend(ev.children)
            if ev.tag != _EventType.Allocation:
                continue
            fields: Any = ev.extra_fields  # an allocation event: typed as the union of all kinds
            if fields.device.type != "cpu" or not fields.alloc_size:
                continue
            out.append((int(ev.start_time_ns), int(fields.alloc_size), int(fields.ptr)))
        return out
    except (AttributeError, ImportError, RuntimeError):
        return None


# ---- added for benchmarks (checked 2.13.0) -------------------------------------------------------
# What the benchmarks and the test zoo's graph capture (``memfit.bench``, ``benchmarks/``) need
# beyond the package itself: AOTAutograd's own default partition, to record joint graphs without
# changing them, and the knobs of ``torch.compile``, the peer memfit's budget is compared with.

# make_boxed_func: a forward compiler's result in AOTAutograd's boxed calling convention.
from torch._functorch.aot_autograd import make_boxed_func  # noqa: E402
from torch._functorch.partitioners import default_partition  # noqa: E402


def activation_memory_budget(fraction: float) -> AbstractContextManager[Any]:
    """A context in which ``torch.compile`` saves at most ``fraction`` of its activations.

    ``torch._functorch.config.activation_memory_budget`` (checked 2.13.0): the min-cut
    partitioner's knapsack budget, as a fraction of the activations its default partition saves;
    read when a graph is partitioned, so the context must span compilation and the first backward.
    """
    import torch._functorch.config

    return torch._functorch.config.patch(activation_memory_budget=fraction)


def automatic_dynamic_shapes(enabled: bool) -> AbstractContextManager[Any]:
    """A context in which Dynamo does (or does not) capture a size that changed as a symbol.

    ``torch._dynamo.config.automatic_dynamic_shapes`` (checked 2.13.0): off, every new size is
    captured again with static shapes, as memfit did before one capture served many sizes
    (``benchmarks/variable_shapes.py`` times both).
    """
    return _dynamo_config.patch(automatic_dynamic_shapes=enabled)


def inductor_post_grad_pass(
    graph_pass: Callable[[fx.Graph], None],
) -> AbstractContextManager[Any]:
    """A context in which Inductor shows ``graph_pass`` every forward and backward graph.

    ``torch._inductor.config.post_grad_custom_post_pass`` (checked 2.13.0). A plain callable (not
    a ``CustomGraphPass``) also makes Inductor bypass its FX graph cache, so every graph compiles.
    """
    import torch._inductor.config

    return torch._inductor.config.patch(post_grad_custom_post_pass=graph_pass)


# ---- the Inductor executor (checked 2.13.0) ------------------------------------------------------
def inductor_decompositions() -> dict[Any, Callable[..., Any]]:
    """The decompositions ``torch.compile``'s Inductor backend traces joint graphs with.

    ``torch._inductor.decomposition.select_decomp_table`` (checked 2.13.0): batch norm, GELU and
    the like become elementwise ops and reductions Inductor can fuse; the graph memfit plans is the
    one Inductor compiles.
    """
    import torch._inductor.config

    # Some decompositions (max_pool2d_with_indices) ask Inductor's lowerings whether to fall
    # back, through the module attribute, which exists only once the module is imported.
    import torch._inductor.lowering  # noqa: F401
    from torch._inductor.decomposition import select_decomp_table

    # With fallback_random (see inductor_compile) the table leaves random ops (dropout) whole,
    # so they draw from eager's generator as eager's kernels do.
    with torch._inductor.config.patch(fallback_random=True):
        return dict(select_decomp_table())


def inductor_joint_graph_passes(joint: fx.GraphModule) -> None:
    """What ``torch.compile`` does to a joint graph before it partitions it, in place.

    Checked 2.13.0: Inductor's ``partition_fn`` (``torch._inductor.compile_fx``) runs
    ``_recursive_joint_graph_passes`` (ATen canonicalisation, no-op removal, folding of uniform
    constants, Inductor's pattern rewrites), then ``min_cut_rematerialization_partition`` drops
    dead code. (It then merges common subexpressions, ``fx_graph_cse``; memfit merges only the
    backward's, ``capture.merge``.) ``fallback_random`` is on, as when memfit compiles
    (``inductor_compile``): random ops are left to eager's kernels rather than rewritten into
    Inductor's.
    """
    import torch._inductor.config
    from torch._inductor.compile_fx import _recursive_joint_graph_passes, get_inputs_devices

    device = get_inputs_devices([], joint)[0]  # from the nodes' values, as compile_fx finds it
    with torch._inductor.config.patch(fallback_random=True):
        rewritten = _recursive_joint_graph_passes(
            joint, skip_invoke_subgraph=True, input_device=device
        )
    if rewritten is not joint:
        joint.graph = rewritten.graph
    joint.graph.eliminate_dead_code()
    joint.recompile()


def inductor_compile(
    gm: fx.GraphModule,
    example_inputs: Any,
    *,
    is_backward: bool,
    is_inference: bool,
    layout_opt: bool | None = None,
    schedules: list[tuple[list[tuple[str, bool, int, int, int, int]], list[str]]] | None = None,
    static_inputs: Sequence[int] = (),
    donated_inputs: Sequence[int] = (),
) -> Callable[[list[Any]], Any]:
    """``gm`` compiled by Inductor as one forward, backward or inference graph.

    ``torch._inductor.compile_fx.compile_fx_inner`` (checked 2.13.0): the per-graph compiler that
    ``torch.compile``'s own AOTAutograd forward and backward compilers call after partitioning.
    The result takes its inputs as one list (boxed) and clears it, as memfit's FX executor does.
    Outputs marked ``user_visible_output_idxs`` keep the strides of their traced values.
    ``layout_opt`` is Inductor's choice of channels-last layouts for convolutions (None: Inductor
    decides per graph); False also turns off ``torch._inductor.config.layout_optimization``
    while the graph compiles. ``torch._inductor.config.fallback_random`` is on while it compiles.

    ``schedules``: a list that receives the buffer timeline of the order Inductor runs its
    kernels in (see ``inductor_schedule``); Inductor's on-disk graph cache is then off for this
    compile, since a graph loaded from it is never scheduled.

    ``torch._inductor.config.cpp_wrapper`` is honoured as ``torch.compile`` honours it: its
    ``compile_fx`` passes it to ``compile_fx_inner`` as an argument (the config alone does not
    reach the graph's code generation), so memfit does the same. Without this a user who set it
    got Python wrappers from memfit and C++ ones from ``torch.compile``.

    ``static_inputs``: positions of inputs whose storage does not move between calls, passed as
    ``compile_fx_inner``'s ``static_input_idxs`` (checked 2.13.0), which ``torch.compile``'s
    forward compiler fills with the parameters' and buffers' positions and its backward compiler
    with the saved values'. Outside CUDA graphs it decides one thing: on a GPU, each input not
    listed there (or not aligned in its example) has its alignment checked on every call
    (``get_input_idxs_to_check``; a ``copy_if_misaligned`` per input in the generated code).

    ``donated_inputs``: positions of a backward's inputs whose storage Inductor may reuse for its
    own buffers after their last read (``DonatedBuffer``). Inductor reads them from
    ``torch._inductor.utils.get_donated_idxs`` (checked 2.13.0: ``GraphLowering.__init__`` calls
    it, as ``torch._inductor.graph.get_donated_idxs``), which returns AOTAutograd's
    ``bw_donated_idxs`` from the tracing context; memfit compiles its backward while it
    partitions, before AOTAutograd has found them, so that name answers with memfit's positions
    while the graph compiles.
    """
    import torch._inductor.config
    import torch._inductor.graph as inductor_graph
    from torch._inductor.compile_fx import compile_fx_inner

    # Random ops (dropout) run as eager's kernels on eager's generator: the same masks as plain
    # PyTorch, and the graph needs none of Inductor's joint-graph rewrites of random ops.
    patch: dict[str, Any] = {"fallback_random": True}
    if layout_opt is not None:
        patch["layout_optimization"] = layout_opt
    if schedules is not None:
        patch["fx_graph_cache"] = False
        patch["reorder_for_peak_memory"] = True
    donated = list(donated_inputs)
    with (
        torch._inductor.config.patch(patch),
        inductor_schedule(schedules),
        unittest.mock.patch.object(inductor_graph, "get_donated_idxs", lambda: donated),
    ):
        return compile_fx_inner(
            gm,
            example_inputs,
            is_backward=is_backward,
            is_inference=is_inference,
            layout_opt=layout_opt,
            cpp_wrapper=bool(torch._inductor.config.cpp_wrapper),
            static_input_idxs=list(static_inputs),
        )


@contextlib.contextmanager
def inductor_schedule(
    schedules: list[tuple[list[tuple[str, bool, int, int, int, int]], list[str]]] | None,
) -> Iterator[None]:
    """While Inductor compiles, append to ``schedules`` the buffers of each graph it schedules.

    Inductor's scheduler picks its kernel order last, in
    ``torch._inductor.memory.reorder_for_peak_memory`` (checked 2.13.0: the scheduler imports it
    from that module when it runs, so wrapping the module's function sees every call), from the
    fused nodes and their buffers. The wrapper keeps Inductor's choice and records, for that
    order, each buffer as ``(name, is_graph_input, bytes_allocated, bytes_freed, first_step,
    last_step)`` (``last_step`` -1: a graph output, never freed), from Inductor's own
    ``compute_memory_timeline``: the lifetimes its generated code frees buffers by; and, for each
    graph output in order, the buffer it is (a view of): ``GraphLowering.get_output_names``.
    """
    if schedules is None:
        yield
        return
    import torch._inductor.memory as inductor_memory

    original = inductor_memory.reorder_for_peak_memory

    def recording(
        nodes: Any,
        name_to_buf: Any,
        name_to_fused_node: Any,
        graph_inputs: Any,
        graph_outputs: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        order = original(
            nodes, name_to_buf, name_to_fused_node, graph_inputs, graph_outputs, *args, **kwargs
        )
        freeable = inductor_memory.get_freeable_input_buf(order, graph_inputs)
        inductor_memory.assign_memory_planning_info_for_scheduler_nodes(
            order, name_to_fused_node, name_to_buf, freeable
        )
        infos, _, _ = inductor_memory.compute_memory_timeline(order, freeable, graph_outputs)
        timeline = []
        for info in infos:
            is_input = isinstance(info.buffer, inductor_memory.FreeableInputBuffer)
            name = info.buffer.get_name()
            timeline.append(
                (name, is_input, info.size_alloc, info.size_free, info.start_step, info.end_step)
            )
        from torch._inductor.virtualized import V

        schedules.append((timeline, list(V.graph.get_output_names())))
        return order

    with unittest.mock.patch.object(inductor_memory, "reorder_for_peak_memory", recording):
        yield


def forward_output_strides() -> AbstractContextManager[Any]:
    """A context receiving the strides Inductor gives a forward graph's outputs (its saved
    values' layouts), as AOTAutograd uses it to compile the backward for them (checked 2.13.0:
    ``TracingContext.report_output_strides``)."""
    from torch._guards import TracingContext

    return TracingContext.report_output_strides()


# ---- added for measurement -----------------------------------------------------------------------
# Refusing to open a profiler session while another thread has one (that crashes); checked 2.13.0.
def profiler_started_anywhere() -> bool:
    """Whether a torch profiler started from Python is active on *any* thread (checked 2.13.0).

    ``torch.autograd.profiler._is_profiler_enabled`` is the process-wide flag every Python-started
    session (``torch.profiler.profile``, the legacy profiler) sets; ``profiler_enabled`` sees only
    this thread. Starting a second session on another thread crashes the process, so memfit looks.
    """
    return bool(getattr(torch.autograd.profiler, "_is_profiler_enabled", False))
