"""Autograd and AOTAutograd's runtime: tangents, the ctx of a compiled function, buffer donation,
the engine's gradient accumulation, FX's boxed calling convention.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

import torch
import torch.fx as fx
from torch.fx.graph import _BoxedCodeGen

__all__ = [
    "accumulate_grad_nodes",
    "backward_keeps_graph",
    "boxed_codegen",
    "compiled_backward_ctx",
    "compiled_function_ctx",
    "donated_buffers_enabled",
    "eager_module_calls",
    "has_gradient_hooks",
    "is_tangent",
    "mark_boxed_call",
    "own_donation",
    "will_engine_accumulate",
]

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


def donated_buffers_enabled() -> bool:
    """Whether AOTAutograd lets a backward write into its donated saved values
    (``torch._functorch.config.donated_buffer``, checked 2.13.0; on by default). Read on each
    call, so ``torch._functorch.config.patch`` turns memfit's donation off with torch's."""
    import torch._functorch.config

    return bool(torch._functorch.config.donated_buffer)


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


def has_gradient_hooks(leaf: torch.Tensor) -> bool:
    """Whether a hook registered on ``leaf`` would see its gradient: ``register_hook``'s
    (``_backward_hooks``) or ``register_post_accumulate_grad_hook``'s
    (``_post_accumulate_grad_hooks``), each None or an empty dict when there is none (checked
    2.13.0). Such a gradient must reach ``.grad`` through AccumulateGrad, which runs them."""
    return bool(getattr(leaf, "_backward_hooks", None)) or bool(
        getattr(leaf, "_post_accumulate_grad_hooks", None)
    )


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


_Boxed = TypeVar("_Boxed", bound=Callable[..., Any])


def mark_boxed_call(run: _Boxed) -> _Boxed:
    """``run``, marked as taking its inputs as one list (AOTAutograd's boxed calling convention).

    AOTAutograd calls a compiled forward or backward with one list of inputs where the function
    carries ``_boxed_call = True`` (what ``torch._functorch.aot_autograd.make_boxed_func`` sets on
    the wrapper it makes, checked 2.13.0), and unpacks them otherwise. Marking memfit's own
    function spares the wrapper, and lets the function clear the list as it reads it.
    """
    run._boxed_call = True  # type: ignore[attr-defined]
    return run
