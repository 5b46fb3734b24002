"""Sizes (``analysis.sizes``): symbolic sizes read at their hints without a guard, or at any
values of their symbols."""

from __future__ import annotations

import sympy
import torch
import torch.nn as nn

from memfit.analysis.sizes import HINTS, Sizes
from memfit.bench.graphs import joint_graphs


def test_values_substitute_into_expressions_and_are_cached() -> None:
    s, t = sympy.Symbol("s"), sympy.Symbol("t")
    sizes = Sizes({s: 10, t: 3})
    assert sizes(768 * s + 4) == 7684
    assert sizes(s * t // 2) == 15
    assert sizes(42) == 42
    assert sizes.key == (("s", 10), ("t", 3))
    assert dict(sizes) == {s: 10, t: 3}
    assert sizes.scaled(0.25).key == (("s", 2), ("t", 2))  # Dynamo never gives a symbol 0 or 1
    assert sizes.scaled(4).key == (("s", 40), ("t", 12))


def test_a_symbolic_size_reads_its_hint_and_adds_no_guard() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh())
    (jg,) = joint_graphs(model, torch.randn(8, 16), dynamic=True)
    (symbol,) = jg.symbols
    tanh = next(n for n in jg.forward if n.target is torch.ops.aten.tanh.default)
    numel = tanh.meta["val"].numel()
    assert isinstance(numel, torch.SymInt)
    env = numel.node.shape_env
    guards = len(env.guards)
    assert HINTS(numel) == 8 * 32
    assert Sizes({symbol: 5})(numel) == 5 * 32
    assert len(env.guards) == guards  # int(numel) would have added Eq(s, 8)
