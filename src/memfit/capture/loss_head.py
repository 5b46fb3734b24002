"""Find a language model's loss head in a captured model and rewrite it to a kernel that never
builds the ``[tokens, vocab]`` logits for the loss.

Once its layers are checkpointed, a language model's per-sample floor is its loss head:
``cross_entropy(lm_head(h))`` keeps a ``[tokens, vocab]`` log-softmax for backward and builds the
logits' gradient in it, at vocab 2048 already more than a 128-wide layer's whole checkpoint
(docstring of ``memfit.nn.linear_cross_entropy``, the kernel this pass rewrites to).

The pass reads the Dynamo graph, before AOTAutograd, as the attention pass does. It finds a
``cross_entropy(x, target)`` (or ``nll_loss(log_softmax(x))``) with class-index targets, an int
``ignore_index``, reduction ``"mean"`` or ``"sum"``, no class weights and no label smoothing,
whose ``x`` comes from ``F.linear(h, W[, b])`` through only ops that move whole rows of logits:
casts (HF's ``logits.float()``), ``contiguous``, ``view``/``reshape``/``flatten`` that keep the
vocab dim last, and slices of the token dims (an older HF shift, ``logits[..., :-1, :]``). Those
ops are replayed on ``h`` (a row of logits is a row of ``h`` times ``W^T``), and the loss becomes
``memfit.nn.linear_cross_entropy(h_rows, W, target, b, ...)``. That is how transformers 5's
``ForCausalLMLoss`` lowers in the graph: ``lm_head(h).float().view(-1, V)`` into
``cross_entropy(..., ignore_index=-100)``, the labels shifted on their own side.

The linear itself stays where something else reads its output (a model returning its logits:
computed once in forward, as before, and never saved for backward nor differentiated unless the
caller backpropagates through them); with no other reader it is erased. Where the rewrite does
not apply, the graph is left as written and the site is reported with the reason, as
``Options(loss_head="off")`` leaves every head.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from memfit._compat import size_hint
from memfit.capture.attention.dynamo_nodes import (
    LINEAR,
    Calls,
    argument,
    erase_unused,
    is_call,
    is_cast,
    location,
    shape_of,
    shown,
    value_of,
)
from memfit.choice import Choice
from memfit.nn.linear_cross_entropy import default_token_chunk, linear_cross_entropy

__all__ = ["LossHead", "LossHeadSite", "replace_loss_heads"]


class LossHead(Choice):
    """What memfit does with a language model's loss head (``Options.loss_head``)."""

    #: rewrite ``cross_entropy(linear(h))`` to memfit's chunked kernel, which never builds the
    #: ``[tokens, vocab]`` logits for the loss nor their gradient
    AUTO = "auto"
    #: leave the loss head as written
    OFF = "off"


@dataclass(frozen=True)
class LossHeadSite:
    """One loss head found in a captured graph: rewritten (``fused``) or not, and why."""

    where: str
    fused: bool
    reason: str
    logits_shape: tuple[int, ...]

    def __str__(self) -> str:
        shape = "x".join(str(s) for s in self.logits_shape)
        done = "-> memfit linear_cross_entropy" if self.fused else "left alone"
        return f"{self.where}: [{shape}] logits {done} ({self.reason})"


CROSS_ENTROPY: Calls = ((F.cross_entropy,), ())
NLL_LOSS: Calls = ((F.nll_loss,), ())
LOG_SOFTMAX: Calls = (
    (F.log_softmax, torch.log_softmax, torch.special.log_softmax, torch.Tensor.log_softmax),
    ("log_softmax",),
)
RESHAPES: Calls = ((torch.reshape, torch.flatten), ("view", "reshape", "flatten"))
GETITEM: Calls = ((operator.getitem,), ())


class _Skip(Exception):
    """The loss is not a head this pass can rewrite; the message says why."""


@dataclass
class _Head:
    loss: fx.Node  # the cross_entropy (or nll_loss) call
    erased: list[fx.Node]  # the loss and, for nll_loss, its log_softmax
    linear: fx.Node
    chain: list[fx.Node]  # from the linear's output to the loss's input, in order
    target: fx.Node
    ignore_index: int
    reduction: str
    dtype: torch.dtype  # of the logits the loss reads


_LOSS_ARGS = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction")


def _loss_arguments(loss: fx.Node) -> tuple[Any, fx.Node, int, str]:
    """``(input, target, ignore_index, reduction)`` of a cross_entropy or nll_loss call."""
    args = {n: argument(loss, i, n) for i, n in enumerate(_LOSS_ARGS)}
    ignore = argument(loss, 4, "ignore_index", -100)
    reduction = argument(loss, 6, "reduction", "mean")
    smoothing = argument(loss, 7, "label_smoothing", 0.0)
    if args["weight"] is not None:
        raise _Skip("class weights")
    if args["size_average"] is not None or args["reduce"] is not None:
        raise _Skip("the deprecated size_average/reduce arguments")
    if smoothing != 0.0:
        raise _Skip(f"label smoothing ({smoothing})")
    if reduction not in ("mean", "sum"):
        raise _Skip(f"reduction {reduction!r} (the kernel reduces to a mean or a sum)")
    if isinstance(ignore, bool) or not isinstance(ignore, int):
        raise _Skip(f"ignore_index computed in the model ({ignore})")
    target = args["target"]
    value = value_of(target)
    if not isinstance(value, torch.Tensor) or value.is_floating_point() or value.dim() != 1:
        raise _Skip("targets that are not a 1-D tensor of class indices")
    return args["input"], target, ignore, reduction


def _rows_only(index: Any, dim: int) -> bool:
    """Whether ``x[index]`` on an ``x`` of ``dim`` dims selects token rows only, leaving the last
    (vocab) dim whole: ints, slices and one Ellipsis, the last dim's entry a plain ``:``."""
    items = index if isinstance(index, tuple) else (index,)
    if not all(isinstance(i, (int, slice)) or i is Ellipsis for i in items):
        return False
    if any(isinstance(i, bool) for i in items) or sum(i is Ellipsis for i in items) > 1:
        return False
    bounds = [b for i in items if isinstance(i, slice) for b in (i.start, i.stop, i.step)]
    if any(isinstance(b, fx.Node) for b in bounds):
        return False  # bounds computed in the graph: replayed on h they would keep the logits
    whole = slice(None, None, None)
    if Ellipsis in items:
        after = items[items.index(Ellipsis) + 1 :]
        return not after or after[-1] == whole
    return len(items) < dim or items[-1] == whole


#: The fewest chunks of the kernel (``default_token_chunk`` tokens each) a head's logits must
#: span to be rewritten (``replace_loss_heads(min_chunks=)``). Within one chunk the kernel builds
#: the whole logits block in forward and again in backward, which saves nothing over plain
#: autograd and costs its own buffers (a tiny ViT's classifier peaked 16 KiB above plain's step
#: when rewritten); 1 rewrites every head (the tests of the rewrite on tiny models).
MIN_CHUNKS = 2


def _compute_size(dtype: torch.dtype) -> int:
    """Bytes of an element of the kernel's compute dtype (half types compute in float32)."""
    return 4 if dtype in (torch.bfloat16, torch.float16) else dtype.itemsize


def _match(loss: fx.Node, min_chunks: int) -> _Head:
    x, target, ignore, reduction = _loss_arguments(loss)
    erased = [loss]
    if is_call(loss, NLL_LOSS):
        if not is_call(x, LOG_SOFTMAX):
            raise _Skip("nll_loss of something other than log_softmax")
        if len(x.users) != 1:
            raise _Skip("the log-probabilities have another reader")
        dim = argument(x, 1, "dim")
        extra = [*x.args[2:], *x.kwargs.values()]
        if dim not in (1, -1) or any(isinstance(a, torch.dtype) for a in extra):
            raise _Skip(f"log_softmax over dim {dim} or with a dtype")
        erased.append(x)
        x = argument(x, 0, "input")
    value = value_of(x)
    if not isinstance(value, torch.Tensor) or value.dim() != 2:
        raise _Skip("logits that are not [tokens, vocab]")
    vocab = value.shape[-1]
    chain: list[fx.Node] = []
    node = x
    while not is_call(node, LINEAR):
        if not isinstance(node, fx.Node):
            raise _Skip("logits not computed by a linear layer")
        shape = shape_of(node)
        if shape is None or not shape or shape[-1] != vocab:
            raise _Skip("logits not computed by a linear layer")
        source = node.all_input_nodes[0] if node.all_input_nodes else None
        source_shape = shape_of(source)
        if is_cast(node):
            if not value_of(node).is_floating_point():
                raise _Skip("logits cast to a non-float dtype")
        elif is_call(node, RESHAPES) or is_call(node, GETITEM):
            if source_shape is None or not source_shape or source_shape[-1] != vocab:
                raise _Skip(f"a {node.target} that moves the vocab dim")
            if is_call(node, GETITEM) and not _rows_only(node.args[1], len(source_shape)):
                raise _Skip("an index into the logits that is not a slice of token rows")
            if sum(not isinstance(s, int) for s in shape[:-1]) > 1:
                raise _Skip("a reshape of the logits with two sizes that vary")
        else:
            raise _Skip(f"the logits pass through {node.target}")
        chain.append(node)
        node = node.args[0]
    linear = node
    h, weight = argument(linear, 0, "input"), argument(linear, 1, "weight")
    bias = argument(linear, 2, "bias")
    values = [value_of(h), value_of(weight)] + ([] if bias is None else [value_of(bias)])
    if not all(isinstance(v, torch.Tensor) for v in values):
        raise _Skip("a linear whose inputs are not tensors")
    if len({v.dtype for v in values}) != 1 or values[0].dtype not in (
        torch.float32, torch.float64, torch.bfloat16, torch.float16,
    ):  # fmt: skip
        raise _Skip("a linear of mixed or non-float dtypes (autocast)")
    out = value_of(linear)
    if not isinstance(out, torch.Tensor) or out.dtype != values[0].dtype:
        raise _Skip("a linear under autocast (its output's dtype is not its inputs')")
    if values[1].dim() != 2 or not isinstance(values[1].shape[1], int):
        raise _Skip("a linear weight that is not 2-D, of a fixed width")
    tokens, hidden = size_hint(value.shape[0]), values[1].shape[1]
    size = _compute_size(value.dtype)
    chunk = default_token_chunk(tokens, hidden, vocab, size)
    if -(-tokens // chunk) < min_chunks:  # see MIN_CHUNKS
        within = "one chunk" if tokens <= chunk else f"fewer than {min_chunks} chunks"
        raise _Skip(f"logits within {within} ({tokens * vocab * size} bytes): nothing to save")
    return _Head(loss, erased, linear, chain[::-1], target, ignore, reduction, value.dtype)


def _replay(graph: fx.Graph, head: _Head, h: fx.Node, hidden: int) -> fx.Node:
    """``h`` through the chain's row moves, then ``[rows, hidden]``: the logits' rows as rows
    of h (``_match`` checked each reshape has at most one size that varies, its -1)."""
    for node in head.chain:
        if is_call(node, GETITEM):
            h = graph.call_function(operator.getitem, (h, node.args[1]))
        elif is_call(node, RESHAPES):
            rows = list((shape_of(node) or ())[:-1])
            varying = [i for i, s in enumerate(rows) if not isinstance(s, int)]
            sizes = [-1 if i in varying else s for i, s in enumerate(rows)]
            h = graph.call_method("reshape", (h, *sizes, hidden))
    return graph.call_method("reshape", (h, -1, hidden))


def _rewrite(gm: fx.GraphModule, head: _Head) -> None:
    graph = gm.graph
    h, weight = argument(head.linear, 0, "input"), argument(head.linear, 1, "weight")
    bias = argument(head.linear, 2, "bias")
    with graph.inserting_before(head.loss):
        rows = _replay(graph, head, h, value_of(weight).shape[1])
        new = graph.call_function(
            linear_cross_entropy,
            (rows, weight, head.target),
            {
                "bias": bias,
                "ignore_index": head.ignore_index,
                "reduction": head.reduction,
                "dtype": head.dtype,
            },
        )
    head.loss.replace_all_uses_with(new)
    erase_unused(graph, [*head.erased, *head.chain, head.linear])


def replace_loss_heads(gm: fx.GraphModule, *, min_chunks: int = MIN_CHUNKS) -> list[LossHeadSite]:
    """Rewrite, in place, every loss head of a Dynamo graph whose logits span at least
    ``min_chunks`` of the kernel's chunks (``MIN_CHUNKS`` says why not fewer); return what was
    found and done."""
    sites: list[LossHeadSite] = []
    for node in list(gm.graph.nodes):
        if node.graph is not gm.graph or not (
            is_call(node, CROSS_ENTROPY) or is_call(node, NLL_LOSS)
        ):
            continue
        shape = shown(shape_of(argument(node, 0, "input")) or ())
        try:
            head = _match(node, min_chunks)
        except _Skip as skip:
            sites.append(LossHeadSite(location(node), False, str(skip), shape))
            continue
        _rewrite(gm, head)
        reason = "the logits' rows are computed in chunks, in forward and again in backward"
        sites.append(LossHeadSite(location(node), True, reason, shape))
    if any(site.fused for site in sites):
        gm.graph.lint()
        gm.recompile()
    return sites
