"""How memfit's split graphs run: boxed, so each input is freed after its last use, the
backward specialized to the tangents that arrive as None and to the parameters whose ``.grad`` it
adds into, and a planned graph's outputs watched until its first backwards.

The compiled graphs run as plain FX code (no Inductor), op for op the kernels eager PyTorch would
call, which is what keeps losses and gradients equal to plain PyTorch. Compilers are "boxed" so
the backward graph receives its saved tensors in a list it may clear: a saved value is freed
after its last use in backward instead of living until the whole backward ends.

The ``*_META`` keys name what ``execution.partitioner`` leaves in a split graph's metadata for the
compilers that run it (AOTAutograd compiles the backward lazily, at its first run).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from memfit._compat import (
    backward_keeps_graph,
    compiled_backward_ctx,
    compiled_function_ctx,
    mark_boxed_call,
    own_donation,
)
from memfit.capture.tangents import tangent_positions, without_tangents
from memfit.execution.accumulate import (
    LeafNotes,
    accumulate_into_grads,
    accumulating,
    output_values,
)
from memfit.execution.executors import (
    EAGER,
    compile_graph,
)
from memfit.execution.run_chain import ForwardGraph, restore_saved
from memfit.execution.run_chain import current as current_chain
from memfit.execution.start_watch import StartWatch

__all__ = [
    "COMPILED_META",
    "EXAMPLES_META",
    "PLAN_META",
    "SIZES_META",
    "Shared",
    "USER_OUTPUTS_META",
    "WATCH_META",
    "boxed",
    "boxed_backward",
    "boxed_forward",
]


def boxed(
    gm: fx.GraphModule,
    example_inputs: Any,
    on_run: Callable[[list[Any]], None] | None = None,
    executor: str = EAGER,
    kind: str = "inference",
    user_outputs: int | None = None,
    compiled: Callable[[list[Any]], Any] | None = None,
    donate: bool = False,
) -> Callable[..., Any]:
    """Run ``gm`` with the boxed convention *and* let it drop each input after its last use.

    ``make_boxed_func`` alone keeps the argument list alive for the whole call, so every saved
    tensor would live until the backward graph ends. Both executors (``execution.executors``)
    unpack and clear the list first; then a saved value dies right after its last reader, as
    the simulator assumes (measured: without this, ``"none"`` peaked 5-20% above eager).
    ``on_run`` is called with the arguments before every run (a planned forward graph reports
    that it ran, and at which sizes). ``compiled``: ``gm`` already compiled (while planning).
    ``donate``: a backward run once per forward may reuse its donated inputs' storage.
    """
    if compiled is None:
        compiled = compile_graph(gm, example_inputs, executor, kind, user_outputs, donate=donate)

    if on_run is None:

        def run(args: list[Any]) -> Any:
            return compiled(args)

    else:

        def run(args: list[Any]) -> Any:
            on_run(args)
            return compiled(args)

    return mark_boxed_call(run)


PLAN_META = "memfit_plan"
USER_OUTPUTS_META = "memfit_user_outputs"
SIZES_META = "memfit_plans_by_size"
COMPILED_META = "memfit_compiled"
EXAMPLES_META = "memfit_backward_examples"
WATCH_META = "memfit_start_watch"


def boxed_forward(
    gm: fx.GraphModule,
    example_inputs: Any,
    on_run: Callable[[list[Any]], None] | None = None,
    executor: str = EAGER,
    chained: bool = False,
) -> Callable[..., Any]:
    """``boxed``, and the outputs the loss does not read get no gradient, as in eager.

    By default autograd hands an ``autograd.Function`` zeros for every output that got no
    gradient; turning that off lets the backward skip them (``capture.tangents``). Until its
    first backward, a planned graph's outputs are watched (``execution.start_watch``).
    ``chained``: its training runs join the step's chain where one is recording
    (``execution.run_chain``), which may drop what they keep and replay them in the backward.
    """
    own_donation()  # memfit's backward decides what it writes into (boxed_backward)
    user_outputs = gm.meta.get(USER_OUTPUTS_META)
    compiled = gm.meta.get(COMPILED_META)
    if compiled is None:
        compiled = compile_graph(gm, example_inputs, executor, "forward", user_outputs)
    run_graph = boxed(gm, example_inputs, on_run, executor, "forward", user_outputs, compiled)
    plan = gm.meta.get(PLAN_META)
    graph = None
    if chained and user_outputs is not None and plan is not None:
        graph = ForwardGraph(gm, compiled, user_outputs, droppable=not plan.transfers)
    shared = gm.meta.get(WATCH_META)
    watch: StartWatch | None = shared.value if shared is not None else None
    if watch is not None and user_outputs is not None:
        watch.forward_graph(gm, user_outputs)

    leaves = LeafNotes()

    def run(args: list[Any]) -> Any:
        ctx = compiled_function_ctx()
        if ctx is None:
            return run_graph(args)
        ctx.set_materialize_grads(False)
        leaves.note(ctx, args)  # the backward adds into their .grad (execution.accumulate)
        chain = current_chain() if graph is not None else None
        if chain is None or graph is None:
            outputs = run_graph(args)
        else:
            outputs = chain.run(ctx, graph, args, run_graph)
        if watch is not None and watch.pending:
            watch.note_forward(ctx, outputs)
        return outputs

    return mark_boxed_call(run)


class Shared:
    """A value in a graph's metadata that copies of the graph share: AOTAutograd deep-copies the
    backward graph before compiling it, and fake tensors cannot be copied outside their mode."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __deepcopy__(self, memo: dict[int, Any]) -> Shared:
        return self


def boxed_backward(
    gm: fx.GraphModule,
    example_inputs: Any,
    on_run: Callable[[list[Any]], None] | None = None,
    executor: str = EAGER,
) -> Callable[..., Any]:
    """``boxed``, specialized to the tangents that arrive as None (``capture.tangents``) and
    to the parameters whose ``.grad`` it adds into (``execution.accumulate``)."""
    tangents = tangent_positions(gm)
    precompiled = gm.meta.get(COMPILED_META)  # for every tangent, no .grad to add into
    # Compiled while planned, the forward reported its saved values' layouts to memfit, not to
    # AOTAutograd, whose examples then have eager's strides: compile for the reported ones.
    shared = gm.meta.get(EXAMPLES_META)
    if shared is not None:
        example_inputs = shared.value
    bases: dict[frozenset[str], tuple[fx.GraphModule, list[torch.Tensor | None]]] = {}
    graphs: dict[tuple[frozenset[str], frozenset[int], bool], Callable[..., Any]] = {}
    shared_watch = gm.meta.get(WATCH_META)
    watch: StartWatch | None = shared_watch.value if shared_watch is not None else None

    def run(args: list[Any]) -> Any:
        if on_run is not None:
            on_run(args)
        missing = frozenset(name for i, name in tangents if args[i] is None)
        if missing not in bases:
            base = without_tangents(gm, set(missing)) if missing else gm
            bases[missing] = (base, output_values(base))
        base, values = bases[missing]
        # The node the engine runs, or AOTAutograd's _backward_impl(ctx, ...) a few frames up.
        ctx = compiled_backward_ctx()
        if ctx is None:
            ctx = compiled_function_ctx(frames=5)
        if watch is not None and watch.pending:
            watch.note_backward(ctx, missing)
        restore_saved(ctx, args)  # what a dropped run of a chain left out (execution.run_chain)
        positions, grads = accumulating(ctx, values)
        # A backward that keeps the graph (retain_graph=True) may run again on the same saved
        # values: it must not write into them (execution.executors.DONATED).
        once = not backward_keeps_graph()
        key = (missing, positions, once)
        if key not in graphs:
            specialized = accumulate_into_grads(base, positions) if positions else base
            examples = list(example_inputs) + [values[i] for i in sorted(positions)]
            graphs[key] = boxed(
                specialized,
                examples,
                executor=executor,
                kind="backward",
                compiled=None if missing or positions or not once else precompiled,
                donate=once,
            )
        args.extend(grads)  # the trailing inputs of an accumulating graph
        return graphs[key](args)

    return mark_boxed_call(run)
