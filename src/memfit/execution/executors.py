"""How a planned forward or backward graph runs: as FX code on eager kernels, or through Inductor.

``"eager"`` runs each graph as plain FX code, op for op the ATen kernels eager PyTorch calls:
losses and gradients equal plain PyTorch's bit for bit, and the simulator's op-by-op replay is
exactly what runs. ``"inductor"`` hands the same graphs (memfit's partition: what is kept,
recomputed and offloaded, recomputation placed just before its gradients) to Inductor, the
compiler behind ``torch.compile``: elementwise ops and reductions are fused into generated
kernels, so a value that lives only inside a fused kernel is never allocated, and the step runs
at ``torch.compile``'s speed. Results then equal plain PyTorch's to floating-point tolerance (a
fused kernel sums in another order), as ``torch.compile``'s do.

Both take their inputs as one list (AOTAutograd's boxed convention) and clear it as they unpack
it, so a saved value is freed after its last reader in backward instead of living until the
graph ends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.fx as fx

from memfit._compat import (
    boxed_codegen,
    dense_memory_format,
    donated_buffers_enabled,
    forward_output_strides,
    inductor_compile,
    inductor_decompositions,
    size_hint,
)
from memfit.analysis.scheduled import Schedule
from memfit.capture.mark import strip_marks
from memfit.choice import Choice

__all__ = [
    "Executor",
    "EAGER",
    "INDUCTOR",
    "STATIC_INPUT",
    "DONATED",
    "CompiledPair",
    "compile_graph",
    "compile_pair",
    "decompositions",
]


class Executor(Choice):
    """How a planned forward and backward run."""

    #: op for op on the ATen kernels eager PyTorch calls: losses and gradients bit for bit
    EAGER = "eager"
    #: the same plan compiled by Inductor (``torch.compile``'s compiler): fused kernels,
    #: results to floating-point tolerance
    INDUCTOR = "inductor"


EAGER = Executor.EAGER
INDUCTOR = Executor.INDUCTOR

#: Inductor's channels-last layouts for convolution graphs ("layout optimization"): Inductor's own
#: choice (None), as in ``torch.compile``. With it Inductor copies convolution weights and inputs
#: into channels-last buffers of its own, memory no graph memfit simulated, but oneDNN's
#: convolutions then need far less scratch: measured on the budget frontier's models (CPU), with
#: it off the predictions were exact on the ResNet but memfit's steps 1.32x (ResNet) and 1.57x
#: (U-Net) torch.compile's at equal peak and the U-Net's peaks higher; with it on, 1.10x and
#: 1.15x, predictions within -3% (ResNet, measured above) to +50% (U-Net, measured below)
#: (docs/measurements.md).
LAYOUT_OPTIMIZATION: bool | None = None

#: Placeholder meta marking a graph input whose storage stays where it is from call to call:
#: parameters and buffers in a forward graph, the saved values in a backward graph
#: (``execution.split``). Inductor is told (its ``static_input_idxs``, as ``torch.compile``'s
#: AOTAutograd compilers tell it) and on a GPU then skips the check of each such input's
#: alignment it otherwise makes on every call.
STATIC_INPUT = "memfit_static_input"

#: Placeholder meta marking a backward graph input that is a saved value no other tensor shares a
#: storage with (``execution.split``): the argument list is its last reference, so Inductor
#: may write the backward's own buffers into it after its last read, as ``torch.compile``'s
#: backward does with AOTAutograd's donated buffers. Honoured only where the caller says the
#: inputs are used once (``donate``) and AOTAutograd's ``donated_buffer`` is on
#: (``memfit._compat.donated_buffers_enabled``).
DONATED = "memfit_donated"

#: The kinds of graph AOTAutograd hands a compiler.
_KINDS = ("forward", "backward", "inference")


def check_executor(executor: str) -> Executor:
    """``executor`` if memfit knows it, else a ValueError naming the choices."""
    return Executor.parse(executor, "executor", "memfit.Executor")


def decompositions(executor: str) -> dict[Any, Callable[..., Any]] | None:
    """What AOTAutograd decomposes the joint graph with before memfit plans it.

    Inductor fuses what it is given in decomposed form (batch norm as reductions and elementwise
    ops), so the joint graph memfit analyses and partitions is the decomposed one, the graph
    Inductor compiles; the eager executor keeps eager's ops (and so its kernels).
    """
    return inductor_decompositions() if executor == INDUCTOR else None


def compile_graph(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    executor: str,
    kind: str,
    user_outputs: int | None = None,
    schedules: list[Schedule] | None = None,
    donate: bool = False,
) -> Callable[[list[Any]], Any]:
    """``gm`` ready to run under ``executor``, called with its inputs in one list (boxed).

    ``kind`` is ``"forward"``, ``"backward"`` or ``"inference"``. ``user_outputs`` is how many
    of a forward graph's first outputs the user sees (the rest are saved for backward): Inductor
    gives those eager's strides and picks the layout of the rest itself. Inputs the graph does
    not read (a tangent that arrives as None) are not passed to Inductor. ``schedules``
    (Inductor only) receives the buffer timeline of the order Inductor runs the graph in.
    ``donate`` (Inductor, backward): the inputs marked ``DONATED`` are passed once, by a
    backward that does not keep the graph, and Inductor may reuse their storage.
    """
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")
    strip_marks(gm)  # inference graphs (no_grad calls) still contain marks: drop them
    if check_executor(executor) == EAGER:
        gm.graph.set_codegen(boxed_codegen())
        gm.recompile()
        return gm
    return _inductor(gm, list(example_inputs), kind, user_outputs, schedules, donate)


@dataclass
class CompiledPair:
    """A planned forward and backward graph compiled by Inductor, with the buffer timelines of
    the schedules Inductor runs them in (``analysis.scheduled``)."""

    forward: Callable[[list[Any]], Any]
    backward: Callable[[list[Any]], Any]
    forward_schedule: Schedule
    backward_schedule: Schedule
    #: the backward's example inputs in the layouts the forward gives its saved values: what any
    #: other specialization of the backward must be compiled for
    backward_examples: list[Any]


def _same_layout(value: torch.Tensor, stride: Sequence[int]) -> bool:
    """Whether ``value``'s symbolic strides are ``stride`` at the sizes captured (no guard)."""
    own = value.stride()
    if not any(isinstance(d, torch.SymInt) for d in own):
        return False  # plain ints: compared as they are
    return tuple(size_hint(d) for d in own) == tuple(stride)


def compile_pair(fw: fx.GraphModule, bw: fx.GraphModule, user_outputs: int) -> CompiledPair:
    """``fw`` and ``bw`` compiled by Inductor while they are planned, before anything runs.

    AOTAutograd would compile them after the partition returns; compiling them here lets memfit
    read what Inductor's schedule holds and plan again if it holds more than the budget. The
    examples are the graphs' own fake values, as AOTAutograd passes them, and the backward is
    compiled for the layouts Inductor gave the saved values (the forward's output strides), as
    AOTAutograd does: the saved values arrive in those layouts. The backward reuses its donated
    inputs (``DONATED``): a backward that keeps the graph runs another compile.
    """
    fw_examples = [n.meta.get("val") for n in fw.graph.nodes if n.op == "placeholder"]
    forward_schedule: list[Schedule] = []
    with forward_output_strides() as strides:
        forward = _inductor(fw, fw_examples, "forward", user_outputs, forward_schedule)
    output = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
    (outs,) = output.args
    stride_of: dict[str, Any] = {}
    if strides:
        for out, stride in zip(outs, strides):
            if isinstance(out, fx.Node) and stride is not None:
                stride_of[out.name] = stride
    bw_examples = []
    for n in bw.graph.nodes:
        if n.op != "placeholder":
            continue
        value = n.meta.get("val")
        stride = stride_of.get(n.name)
        # Strides with size symbols in them, the layout Inductor gave them: comparing them with
        # Inductor's (at the captured sizes) would guard on the symbols, and the capture would
        # serve that one size only.
        if (
            isinstance(value, torch.Tensor)
            and stride is not None
            and not _same_layout(value, stride)
        ):
            if tuple(value.stride()) != tuple(stride):
                value = value.as_strided(value.size(), stride)
        bw_examples.append(value)
    backward_schedule: list[Schedule] = []
    backward = _inductor(bw, list(bw_examples), "backward", None, backward_schedule, donate=True)
    return CompiledPair(
        forward,
        backward,
        forward_schedule[-1] if forward_schedule else Schedule((), ()),
        backward_schedule[-1] if backward_schedule else Schedule((), ()),
        bw_examples,
    )


def _inductor(
    gm: fx.GraphModule,
    example_inputs: list[Any],
    kind: str,
    user_outputs: int | None,
    schedules: list[Schedule] | None = None,
    donate: bool = False,
) -> Callable[[list[Any]], Any]:
    graph = fx.Graph()  # a copy: one backward graph may be compiled for several specializations
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        env[n] = graph.node_copy(n, lambda x: env[x])
    gm = fx.GraphModule(gm, graph)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        raise ValueError(
            f"graph has {len(placeholders)} inputs but {len(example_inputs)} example inputs"
        )
    unread = [i for i, p in enumerate(placeholders) if not p.users]
    for i in reversed(unread):
        gm.graph.erase_node(placeholders[i])
    read = [i for i in range(len(placeholders)) if i not in set(unread)]
    examples = [example_inputs[i] for i in read]
    static = [j for j, i in enumerate(read) if placeholders[i].meta.get(STATIC_INPUT)]
    donated: list[int] = []
    if donate and kind == "backward" and donated_buffers_enabled():
        donated = [j for j, i in enumerate(read) if placeholders[i].meta.get(DONATED)]
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    (outs,) = output.args
    if kind == "backward":
        outs = _keep_eager_layouts(gm.graph, output)
    if kind != "forward":
        # every output of an inference graph is the user's, and every gradient the caller's, as
        # torch.compile's backward compiler tells Inductor (``bw_outputs_user_visible``)
        user_outputs = len(outs)
    visible = range(min(user_outputs or 0, len(outs)))
    # Inductor's name (compile_fx_forward sets it the same way, checked 2.13.0).
    output.meta["user_visible_output_idxs"] = [i for i in visible if isinstance(outs[i], fx.Node)]
    gm.recompile()
    scheduled: list[tuple[Any, Any]] | None = [] if schedules is not None else None
    compiled = inductor_compile(
        gm,
        examples,
        is_backward=kind == "backward",
        is_inference=kind == "inference",
        layout_opt=LAYOUT_OPTIMIZATION,
        schedules=scheduled,
        static_inputs=static,
        donated_inputs=donated,
    )
    if schedules is not None and scheduled:
        buffers, outputs = scheduled[-1]
        schedules.append(Schedule(tuple(buffers), tuple(outputs)))
    if not unread:
        return compiled

    def run(args: list[Any]) -> Any:
        inputs = [args[i] for i in read]
        args.clear()
        return compiled(inputs)

    return run


def _keep_eager_layouts(graph: fx.Graph, output: fx.Node) -> tuple[Any, ...]:
    """The backward's outputs, each in the dense layout eager gives it: its traced strides.

    Why: Inductor lays out a convolution graph channels-last, and re-derives the backward's
    strides from the layouts its forward gave the saved values, so a convolution's weight
    gradient comes back channels-last while the weight is contiguous, although the backward's
    outputs are meant to keep eager's strides (``torch._inductor.config.bw_outputs_user_visible``,
    which ``torch.compile`` honours only with the strides re-derived). The autograd engine then
    copies each such gradient into the weight's layout (``AccumulateGrad``'s layout contract), an
    ATen copy per weight per step outside the compiled graph: on the frontier's ResNet (CPU) 25
    a step, in ``torch.compile``'s step as in memfit's, and a gradient hook sees a layout eager
    never gives. A ``clone`` to the traced layout, which the re-derivation cannot change, makes
    Inductor write the gradient in that layout; it drops the clone where the layouts agree. The
    clones go at the end of the graph, where Inductor fuses them into one kernel after the last
    convolution, when the activations are gone: placed after each gradient, they were fused into
    the next kernel, mid-backward, and a U-Net plan's compiled peak rose by 0.36 MiB. Measured on
    the ResNet (CPU): the same peaks and no step time changed beyond noise
    (docs/measurements.md). Outputs whose traced strides are no
    dense format, or carry size symbols, are left as Inductor lays them out.
    """
    outs = cast("tuple[Any, ...]", output.args[0])
    pinned: dict[fx.Node, fx.Node] = {}
    for out in outs:
        if not isinstance(out, fx.Node) or out.op == "placeholder" or out in pinned:
            continue
        value = out.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue
        layout = dense_memory_format(value)
        if layout is None:
            continue
        with graph.inserting_before(output):
            clone = graph.call_function(
                torch.ops.aten.clone.default, (out,), {"memory_format": layout}
            )
        clone.meta["val"] = value
        pinned[out] = clone
    new_outs = tuple(pinned.get(o, o) if isinstance(o, fx.Node) else o for o in outs)
    output.args = (new_outs,)
    return new_outs
