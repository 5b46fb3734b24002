"""The simulator: replays orders with frees at last use; its peak matches a measured step."""

import torch
import torch.nn as nn

import memfit
from memfit.analysis.simulate import simulate_step, walk
from memfit.bench.graphs import joint_graphs
from memfit.planning.keep_rules import keep_all


class _Node:
    """A stand-in for fx.Node: walk only reads ``all_input_nodes``."""

    def __init__(self, name: str, inputs: list["_Node"]) -> None:
        self.name = name
        self.all_input_nodes = inputs


def test_walk_frees_after_last_use() -> None:
    a = _Node("a", [])
    b = _Node("b", [a])
    c = _Node("c", [b])
    d = _Node("d", [a, c])
    sizes = {"a": 10, "b": 20, "c": 30, "d": 40}
    result = walk([a, b, c, d], lambda n: [n.name], sizes, keep=["d"])
    # a lives until d; b dies after c: peaks are a+b+c=60 and a+c+d=80
    assert result.peak_bytes == 80
    assert result.end_live == {"d"}
    assert result.end_bytes == 40


def test_walk_counts_scratch_and_skips_uncounted() -> None:
    a = _Node("a", [])
    b = _Node("b", [a])
    result = walk(
        [a, b], lambda n: [n.name], {"a": 5, "b": 7}, uncounted=["a"], op_scratch={b: 100}
    )  # type: ignore[dict-item]
    assert result.peak_bytes == 107


def test_predicted_peak_matches_measured_chain() -> None:
    class Chain(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(20):
                x = torch.tanh(x)
            return x

    x = torch.randn(256, 256, requires_grad=True)
    (jg,) = joint_graphs(Chain(), x)
    predicted = simulate_step(jg, keep_all(jg)).peak_bytes
    wrapped = memfit.checkpoint(Chain(), "none")
    wrapped(x).sum().backward()
    measured = memfit.measure(lambda: wrapped(x).sum().backward()).peak_bytes
    assert measured is not None
    assert abs(predicted - measured) <= 0.05 * measured
