"""Stages of a captured forward: where a model can be cut, what crosses each cut, the stage graphs.

A pipeline needs the model as a chain, and most models are not written as one: HuggingFace
models, skip connections, a loss-free head reading the embedding's weight. So the cut is made in
the forward graph Dynamo captures (the same capture ``memfit.checkpoint`` plans on), whatever the
Python looked like: the graph's nodes in topological order are the chain, a cut is a position in
that order, and everything computed before a cut and read after it crosses it. A value read by a
stage further on than the next one is relayed by every stage in between (each receives it and
sends it on), because a pipeline stage talks only to its neighbours; its bytes count at every
cut it crosses.

Each stage becomes an ``fx.GraphModule`` over the user's own parameter and buffer objects (not
copies), registered under their original qualified names, so ``named_parameters()`` of a stage
reads like the model's, an optimizer on it updates the model, and a BatchNorm's running
statistics are updated in place by the stage that runs it. The stage's nodes are the captured
graph's nodes, so it runs the same ops as eager PyTorch in the same order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from memfit._compat import (
    child_module,
    compile_with_recompile_limit,
    tree_flatten,
    tree_unflatten,
)
from memfit.execution.state import preserved

__all__ = [
    "CapturedForward",
    "PipelineCaptureError",
    "StageGraph",
    "capture_forward",
    "crossing_bytes",
    "item_boundaries",
    "module_path",
    "split_stages",
]

#: captures of one model's forward (one per micro-batch size and ``plan`` call) before Dynamo
#: refuses more
CAPTURE_LIMIT = 256


class PipelineCaptureError(RuntimeError):
    """The model's forward cannot be captured as one graph (a pipeline needs one)."""


@dataclass
class CapturedForward:
    """A model's forward as one Dynamo graph, with its parameters and buffers named.

    ``nodes`` are the graph's computing nodes in topological order (the chain that is cut);
    ``inputs`` the placeholders of the call's tensor arguments, in order; ``state`` maps the
    placeholders of parameters and buffers to their qualified names in the model (a tied
    parameter has the first name ``named_parameters`` gives it) and ``tensors`` those names to
    the objects. The model's output structure is kept so the last stage's flat outputs can be
    given back to a loss function as the model returned them.
    """

    graph: fx.GraphModule
    nodes: list[fx.Node]
    inputs: list[fx.Node]
    state: dict[fx.Node, str]
    tensors: dict[str, torch.Tensor]
    output_spec: Any
    output_leaves: list[int | None]
    output_constants: list[Any]
    parameter_names: frozenset[str] = field(default_factory=frozenset)
    #: the graph's inputs in placeholder order (parameters, buffers and the example inputs)
    placeholder_values: list[Any] = field(default_factory=list)

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The model's buffers the graph reads (BatchNorm statistics): what a run may change."""
        return [t for n, t in self.tensors.items() if n not in self.parameter_names]

    def rebuild_output(self, flat: Sequence[Any]) -> Any:
        """The model's output structure from the graph's flat outputs (the last stage's)."""
        leaves = [
            flat[i] if i is not None else const
            for i, const in zip(self.output_leaves, self.output_constants)
        ]
        return tree_unflatten(leaves, self.output_spec)


def _value(node: Any) -> Any:
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


def tensor_bytes(value: Any) -> int:
    """Bytes of a tensor's elements (0 for anything else): what sending it moves."""
    if isinstance(value, torch.Tensor):
        return math.prod(value.shape) * value.element_size()
    return 0


def module_path(node: fx.Node) -> str:
    """The qualified name of the innermost module a node was traced in ('' at top level)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    if isinstance(path, str) and path.startswith("L["):
        head, _, rest = path.partition(".")
        return rest
    return str(path)


def capture_forward(model: nn.Module, example_inputs: tuple[Any, ...]) -> CapturedForward:
    """Capture ``model(*example_inputs)`` as one graph, without changing the model.

    Runs one forward (grad enabled, so the graph is the training graph) and then restores
    every buffer and the CPU and CUDA random states, so BatchNorm statistics and later dropout
    masks are as if it never ran. Raises ``PipelineCaptureError`` when Dynamo cannot capture the
    forward as one graph (a graph break), naming Dynamo's reason.
    """
    captured: dict[str, Any] = {}

    def backend(gm: fx.GraphModule, example: list[Any]) -> Any:
        captured["gm"] = gm
        captured["example"] = list(example)

        def run(*args: Any) -> Any:
            out = gm(*args)
            captured["outputs"] = out
            return out

        return run

    # a model is captured once per micro-batch size (``schedule="auto"`` tries several) and per
    # ``plan``: Dynamo's limit of 8 captures per forward would refuse the ninth
    compiled = compile_with_recompile_limit(
        model, backend=backend, fullgraph=True, dynamic=False, limit=CAPTURE_LIMIT
    )
    try:
        with preserved(model.buffers()), torch.enable_grad():
            out = compiled(*example_inputs)
    except Exception as exc:
        raise _capture_error(model, exc) from exc
    if "gm" not in captured:
        raise PipelineCaptureError(
            "Dynamo reused an earlier compilation of this model instead of capturing it; "
            "call torch.compiler.reset() before planning a pipeline"
        )
    gm: fx.GraphModule = captured["gm"]
    names, parameter_names = _state_names(model)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    state: dict[fx.Node, str] = {}
    inputs: list[fx.Node] = []
    tensors: dict[str, torch.Tensor] = {}
    for node, value in zip(placeholders, captured["example"]):
        if id(value) in names:
            state[node] = names[id(value)]
            tensors[names[id(value)]] = value
        else:
            inputs.append(node)
    output_leaves, constants, spec = _output_leaves(out, captured.get("outputs", ()))
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    return CapturedForward(
        graph=gm,
        nodes=nodes,
        inputs=inputs,
        state=state,
        tensors=tensors,
        output_spec=spec,
        output_leaves=output_leaves,
        output_constants=constants,
        parameter_names=frozenset(parameter_names),
        placeholder_values=captured["example"],
    )


def _capture_error(model: nn.Module, exc: BaseException) -> PipelineCaptureError:
    """Why Dynamo could not capture ``model``'s forward whole: the first lines of ``exc`` and
    its causes, and what to do when the reason is Dynamo's recompile limit."""
    reasons: list[str] = []
    cause: BaseException | None = exc
    while cause is not None and len(reasons) < 4:
        text = str(cause).strip()
        if text:
            reasons.append(text.splitlines()[0])
        cause = cause.__cause__
    hint = (
        "; Dynamo compiled this forward too many times in this process (a new model or "
        "shape each time): call torch.compiler.reset() before planning again"
        if any("recompile limit" in r.lower() or "recompile_limit" in r for r in reasons)
        else ""
    )
    return PipelineCaptureError(
        f"memfit.pipeline needs {type(model).__name__}'s forward as one graph to cut it into "
        f"stages, and Dynamo could not capture it whole: {' <- '.join(reasons)}{hint}"
    )


def _state_names(model: nn.Module) -> tuple[dict[int, str], set[str]]:
    """Each parameter's and buffer's first name by the tensor's id, and the parameters' names."""
    names: dict[int, str] = {}
    parameter_names = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
        parameter_names.add(names[id(p)])
    for name, b in model.named_buffers(remove_duplicate=False):
        names.setdefault(id(b), name)
    return names, parameter_names


def _output_leaves(out: Any, flat_out: Any) -> tuple[list[int | None], list[Any], Any]:
    """Where each leaf of what the model returned (``out``) is among the captured graph's
    outputs (``flat_out``), the leaves that are no tensor as constants, and ``out``'s spec."""
    positions = {id(t): i for i, t in enumerate(flat_out)}
    leaves, spec = tree_flatten(out)
    output_leaves: list[int | None] = []
    constants: list[Any] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if id(leaf) not in positions:
                raise PipelineCaptureError(
                    "a tensor the model returns is not an output of its captured graph "
                    "(an input returned unchanged?); return values computed by the forward"
                )
            output_leaves.append(positions[id(leaf)])
            constants.append(None)
        else:
            output_leaves.append(None)
            constants.append(leaf)
    return output_leaves, constants, spec


def _is_constant(value: Any) -> bool:
    """A non-tensor value a later stage can hold as a literal (static shapes make sizes such)."""
    if isinstance(value, (int, float, bool, str, torch.dtype, torch.device, type(None))):
        return True
    if isinstance(value, (tuple, list, torch.Size)):
        return all(_is_constant(v) for v in value)
    return False


def _positions(captured: CapturedForward) -> dict[fx.Node, int]:
    pos = {node: -1 for node in captured.inputs}
    pos.update({node: i for i, node in enumerate(captured.nodes)})
    return pos


def _last_reader(captured: CapturedForward, pos: dict[fx.Node, int]) -> dict[fx.Node, int]:
    """For every value, the position of its last reader (``len(nodes)`` for the graph output)."""
    end = len(captured.nodes)
    last: dict[fx.Node, int] = {}
    for node in pos:
        readers = [end if u.op == "output" else pos[u] for u in node.users]
        last[node] = max(readers, default=pos[node])
    return last


def crossing_bytes(captured: CapturedForward) -> list[int]:
    """Bytes crossing each position ``0..len(nodes)``: computed before it, read at or after it.

    Position ``c`` is the cut before node ``c``; a value read past several cuts counts at each
    (it is relayed). Step inputs are computed "before" position 0; parameters never cross.
    Non-tensor values cost nothing (they cross as literals) — ``cut_allowed`` says where a
    non-literal one would have to cross.
    """
    pos = _positions(captured)
    last = _last_reader(captured, pos)
    n = len(captured.nodes)
    delta = [0] * (n + 2)
    for node, p in pos.items():
        size = tensor_bytes(_value(node))
        if size and last[node] > p:
            delta[p + 1] += size
            delta[last[node] + 1] -= size
    out, running = [], 0
    for c in range(n + 1):
        running += delta[c]
        out.append(running)
    return out


def cut_allowed(captured: CapturedForward) -> list[bool]:
    """Whether each position ``0..len(nodes)`` can be a cut: nothing crossing it is unsendable.

    A pipeline stage sends tensors; a non-tensor value computed before a cut and read after it
    must be a literal (sizes under static shapes are) to be re-created on the other side.
    """
    pos = _positions(captured)
    last = _last_reader(captured, pos)
    n = len(captured.nodes)
    allowed = [True] * (n + 1)
    for node, p in pos.items():
        value = _value(node)
        if isinstance(value, torch.Tensor) or _is_constant(value):
            continue
        for c in range(p + 1, min(last[node], n) + 1):
            allowed[c] = False
    return allowed


def item_boundaries(captured: CapturedForward, max_items: int = 128) -> list[int]:
    """Cut positions to choose from: the boundaries between consecutive modules.

    Nodes are grouped by the module they were traced in, at the deepest module level that
    gives at most ``max_items`` groups (blocks of a transformer rather than each of their
    linears); each run of nodes in one group is an item, and the boundaries between items, where
    allowed (``cut_allowed``), are the candidate cuts. Returns the positions, starting with 0 and
    ending with ``len(nodes)``. Fewer positions keep the exact stage search fast; cutting inside
    a block rarely helps balance and moves more bytes.
    """
    n = len(captured.nodes)
    allowed = cut_allowed(captured)
    paths = [module_path(node).split(".") if module_path(node) else [] for node in captured.nodes]
    depth_max = max((len(p) for p in paths), default=0)
    best: list[int] = [0, n]
    for depth in range(1, depth_max + 1):
        keys = [".".join(p[:depth]) for p in paths]
        cuts = [0] + [c for c in range(1, n) if keys[c] != keys[c - 1] and allowed[c]] + [n]
        if len(cuts) - 1 > max_items:
            break
        best = cuts
    if len(best) - 1 < 2 and n > 1:  # no module structure: every allowed node boundary
        best = [0] + [c for c in range(1, n) if allowed[c]] + [n]
    if len(best) - 1 > max_items:  # too many: keep evenly spaced ones
        step = (len(best) - 1) / max_items
        best = sorted({best[round(i * step)] for i in range(max_items)} | {n})
    return best


@dataclass
class StageGraph:
    """One stage: its graph module, what it receives and sends, and what it holds.

    ``receives``/``sends`` are the captured graph's values, in the order the stage takes and
    returns them; a value the stage only relays appears in both. ``module`` returns a tuple of
    the sent values (made contiguous: gloo sends only contiguous tensors), or, for the last stage,
    the graph's flat outputs.
    """

    index: int
    start: int
    end: int
    module: fx.GraphModule
    receives: list[fx.Node]
    sends: list[fx.Node]
    state_names: list[str]
    modules: list[str]

    @property
    def receive_bytes(self) -> int:
        return sum(tensor_bytes(_value(n)) for n in self.receives)

    @property
    def send_bytes(self) -> int:
        return sum(tensor_bytes(_value(n)) for n in self.sends)

    @property
    def receive_grad_bytes(self) -> int:
        """The gradients the stage's backward sends back: of each received value that needs one."""
        values = [_value(n) for n in self.receives]
        return sum(tensor_bytes(v) for v in values if getattr(v, "requires_grad", False))


def _root(names: Sequence[str], captured: CapturedForward) -> nn.Module:
    """A module tree holding exactly ``names`` (the model's own tensors) under those names."""
    root = nn.Module()
    for name in names:
        *path, leaf = name.split(".")
        owner = root
        for part in path:
            child = child_module(owner, part)
            if child is None:
                child = nn.Module()
                owner.add_module(part, child)
            owner = child
        tensor = captured.tensors[name]
        if isinstance(tensor, nn.Parameter):
            owner.register_parameter(leaf, tensor)
        else:
            owner.register_buffer(leaf, tensor)
    return root


def split_stages(captured: CapturedForward, cuts: Sequence[int]) -> list[StageGraph]:
    """The stages between ``cuts`` (positions ``0 < c_1 < ... < len(nodes)``, without the ends).

    Stage ``s`` holds nodes ``[c_s, c_{s+1})``; it receives every tensor computed before it and
    read by it or after it, and sends on everything computed up to its end that later stages
    read. Literal non-tensor values are re-created where read.
    """
    n = len(captured.nodes)
    bounds = [0, *cuts, n]
    if any(b >= e for b, e in zip(bounds, bounds[1:])) or bounds[-1] != n:
        raise ValueError(f"cuts must increase strictly within 1..{n - 1}, got {list(cuts)}")
    allowed = cut_allowed(captured)
    for c in cuts:
        if not allowed[c]:
            raise ValueError(
                f"cannot cut before node {captured.nodes[c].name}: a value that is neither a "
                "tensor nor a literal (a tuple of tensors?) crosses there"
            )
    pos = _positions(captured)
    last = _last_reader(captured, pos)
    order = [*captured.inputs, *captured.nodes]

    def crossing(at: int) -> list[fx.Node]:
        """The tensors computed before ``at`` and read at or after it."""
        return [v for v in order if pos[v] < at <= last[v] and isinstance(_value(v), torch.Tensor)]

    return [
        _stage(captured, s, start, end, crossing(start), [] if end == n else crossing(end))
        for s, (start, end) in enumerate(zip(bounds, bounds[1:]))
    ]


def _stage(
    captured: CapturedForward,
    s: int,
    start: int,
    end: int,
    receives: list[fx.Node],
    sends: list[fx.Node],
) -> StageGraph:
    """Stage ``s``: nodes ``[start, end)`` as a module of their own that takes ``receives`` and
    returns ``sends`` (the last stage: the model's outputs), with the state it reads."""
    is_last = end == len(captured.nodes)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for v in receives:
        env[v] = graph.placeholder(v.name)
    state_names: list[str] = []

    def arg(a: fx.Node) -> fx.Node:
        if a in env:
            return env[a]
        if a in captured.state:
            env[a] = graph.get_attr(captured.state[a])
            state_names.append(captured.state[a])
            return env[a]
        value = _value(a)
        if _is_constant(value):
            return value
        raise ValueError(f"value {a.name} is needed by a stage it does not reach")

    for node in captured.nodes[start:end]:
        env[node] = graph.node_copy(node, arg)
    if is_last:
        output_node = next(iter(captured.graph.graph.find_nodes(op="output")))
        graph.output(fx.map_arg(output_node.args[0], arg))
    else:
        graph.output(tuple(graph.call_method("contiguous", (arg(v),)) for v in sends))
    attrs = {
        node.target
        for node in captured.nodes[start:end]
        if node.op == "get_attr" and isinstance(node.target, str)
    }
    root = _root(state_names, captured)
    for target in attrs:  # Dynamo's own constants
        root.register_buffer(target, getattr(captured.graph, target))
    module = fx.GraphModule(root, graph, class_name=f"Stage{s}")
    seen: list[str] = []
    for node in captured.nodes[start:end]:
        path = module_path(node)
        if path and path not in seen:
            seen.append(path)
    return StageGraph(
        index=s,
        start=start,
        end=end,
        module=module,
        receives=receives,
        sends=sends,
        state_names=state_names,
        modules=seen,
    )
