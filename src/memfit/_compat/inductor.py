"""Inductor: torch.compile's settings the benchmarks compare against, and what the Inductor
executor compiles, decomposes and schedules with.
"""

from __future__ import annotations

import contextlib
import unittest.mock
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch._dynamo.config as _dynamo_config
import torch.fx as fx

__all__ = [
    "activation_memory_budget",
    "automatic_dynamic_shapes",
    "default_partition",
    "forward_output_strides",
    "inductor_compile",
    "inductor_decompositions",
    "inductor_joint_graph_passes",
    "inductor_post_grad_pass",
    "inductor_schedule",
    "make_boxed_func",
]

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
