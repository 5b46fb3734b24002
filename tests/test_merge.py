"""Merging the backward's repeated computations: what merges, and what must not."""

from __future__ import annotations

import torch
import torch.fx as fx

from memfit.capture.merge import merge_backward_duplicates

aten = torch.ops.aten


def _joint() -> tuple[fx.GraphModule, dict[str, fx.Node]]:
    """A joint graph by hand: a forward that repeats itself, a backward that repeats itself."""
    g = fx.Graph()
    x = g.placeholder("primals_1")
    t = g.placeholder("tangents_1")
    n: dict[str, fx.Node] = {}
    n["fw_a"] = g.call_function(aten.relu.default, (x,))
    n["fw_b"] = g.call_function(aten.relu.default, (x,))
    out = g.call_function(aten.add.Tensor, (n["fw_a"], n["fw_b"]))
    n["bw_t"] = g.call_function(aten.mul.Tensor, (t, 2.0))  # the backward begins here
    n["bw_sub_a"] = g.call_function(aten.sub.Tensor, (x, 1.0))
    n["bw_sub_b"] = g.call_function(aten.sub.Tensor, (x, 1.0))
    n["fw_again"] = g.call_function(aten.relu.default, (x,))  # a forward value, again
    n["zero_a"] = g.call_function(aten.full.default, ([], 0.0))
    n["zero_b"] = g.call_function(aten.full.default, ([], 0.0))
    n["zeros_a"] = g.call_function(aten.full.default, ([4, 4], 0.0))
    n["zeros_b"] = g.call_function(aten.full.default, ([4, 4], 0.0))
    n["drop_a"] = g.call_function(aten.bernoulli.p, (x, 0.5))
    n["drop_b"] = g.call_function(aten.bernoulli.p, (x, 0.5))
    n["grad_a"] = g.call_function(aten.mul.Tensor, (n["bw_t"], x))
    n["grad_b"] = g.call_function(aten.mul.Tensor, (n["bw_t"], x))
    acc = n["bw_t"]
    for name in (
        "bw_sub_a",
        "bw_sub_b",
        "fw_again",
        "zero_a",
        "zero_b",
        "zeros_a",
        "zeros_b",
        "drop_a",
        "drop_b",
    ):
        acc = g.call_function(aten.add.Tensor, (acc, n[name]))
    g.output((out, acc, n["grad_a"], n["grad_b"]))
    for name, node in n.items():
        node.meta["val"] = torch.empty(() if name in ("zero_a", "zero_b") else (4, 4))
    return fx.GraphModule(torch.nn.Module(), g), n


def test_only_the_backwards_pure_repeats_merge_into_their_first_copy() -> None:
    gm, n = _joint()
    before = {node.name for node in gm.graph.nodes}
    merged = merge_backward_duplicates(gm)
    left = {node.name for node in gm.graph.nodes}
    gone = before - left
    # a computation the backward repeats, and a scalar constant: one copy each
    assert gone == {n["bw_sub_b"].name, n["zero_b"].name}
    assert merged == 2
    # not merged: the forward's repeats, a backward copy of a forward value (the planner keeps
    # or recomputes a forward value; unmerged, the backward makes its own where needed), zeros
    # the size of a tensor (one copy would live from first reader to last), random draws, and
    # values the graph returns (two gradients must not share a storage)
    for name in ("fw_a", "fw_b", "fw_again", "zeros_a", "zeros_b", "drop_a", "drop_b"):
        assert n[name].name in left, name
    assert {n["grad_a"].name, n["grad_b"].name} <= left


def test_a_graph_without_tangents_is_left_alone() -> None:
    g = fx.Graph()
    x = g.placeholder("primals_1")
    a = g.call_function(aten.relu.default, (x,))
    b = g.call_function(aten.relu.default, (x,))
    g.output((a, b))
    gm = fx.GraphModule(torch.nn.Module(), g)
    assert merge_backward_duplicates(gm) == 0
    assert len(list(gm.graph.nodes)) == 4
