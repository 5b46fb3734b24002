"""Sizes of a graph captured with symbolic shapes: read at the capture's hints, or at any size.

Why: Dynamo captures a model once for a range of input sizes when a size varies between calls
(automatic dynamic shapes): a varying dimension becomes a symbol (``s0``), and every size in the
graph an expression over the symbols (``768*s0``). memfit's facts about a graph (bytes per
storage, FLOPs, the simulator's peak) are numbers, so they are read here, in one of two ways:

* at the *hints*, the sizes of the call that was captured, without adding a guard (reading a
  SymInt as ``int`` would make Dynamo specialize the graph to that size and capture every new
  size again, which is what made variable sequence lengths slow);
* at any other assignment of the symbols, by substituting values into the expressions, which is
  how a plan made at one size is predicted, and checked against a budget, at another.

``Sizes`` is that reading; ``HINTS`` reads at the hints. A graph with static shapes has no
symbols, and every reading is its plain int.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from memfit._compat import size_expr, size_hint

__all__ = ["Sizes", "HINTS", "SizeKey"]

#: A hashable name for one assignment of a graph's symbols: ``(("s0", 96), ("s1", 4))``.
SizeKey = tuple[tuple[str, int], ...]


class Sizes(Mapping[Any, int]):
    """Values for a graph's size symbols (a mapping from sympy symbols to ints).

    Calling it on an int, a SymInt or a sympy expression gives an int: the hint where no value
    is given for the expression's symbols (``HINTS``), the substituted value otherwise. Results
    are cached per expression, since a graph repeats few distinct expressions many times.
    """

    def __init__(self, values: Mapping[Any, int] | None = None) -> None:
        self._values = dict(values or {})
        self._cache: dict[Any, int] = {}

    def __getitem__(self, symbol: Any) -> int:
        return self._values[symbol]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    @property
    def key(self) -> SizeKey:
        """A hashable, printable name for these values, ordered by symbol name."""
        return tuple(sorted((str(s), int(v)) for s, v in self._values.items()))

    def __call__(self, value: Any) -> int:
        if isinstance(value, int):
            return value
        if not self._values:
            return size_hint(value)
        expr = size_expr(value) if isinstance(value, torch.SymInt) else value
        if isinstance(expr, int):
            return expr
        cached = self._cache.get(expr)
        if cached is None:
            if not expr.free_symbols <= self._values.keys():
                cached = size_hint(value) if isinstance(value, torch.SymInt) else int(expr)
            else:
                cached = int(expr.xreplace(self._values))
            self._cache[expr] = cached
        return cached

    def scaled(self, factor: float) -> Sizes:
        """Every symbol's value times ``factor`` (rounded, at least 2: Dynamo specializes 0
        and 1, so a symbol never takes them)."""
        return Sizes({s: max(2, round(v * factor)) for s, v in self._values.items()})

    def __repr__(self) -> str:
        return "Sizes(" + ", ".join(f"{s}={v}" for s, v in self.key) + ")"


#: Every size at the hint it was captured with.
HINTS = Sizes()
