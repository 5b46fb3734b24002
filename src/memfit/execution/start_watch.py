"""Seeing, on a graph's first backward, what its caller held and what got a gradient.

A plan is made before the graph has run, on an assumed start of its backward
(``analysis.backward_start``). The step then shows the truth: which of the forward's outputs are
still alive when the backward starts (the caller's variables, a later graph's saved values), and
which tangents arrive as None. ``StartWatch`` notes weak references to the outputs on the
forward's autograd ctx and reads them when the backward starts; where the start differs from the
planned one, it reports it, and the wrapper plans again with it from the next call where that
matters (``MATERIAL_LOW``, ``MATERIAL_HIGH``; ``execution.session``), once two backwards in a row
agree. It watches a compiled graph's first backwards only: afterwards a step pays nothing for it.

An output counts as held while its tensor object is alive, or, where the forward did not also
save it, while its storage is (a view of it held by the caller keeps the memory). A saved output's
storage stays alive in the graph's own saved values, so for it only the tensor object says
whether the caller holds it (autograd saves an output of its own function as a new tensor on the
same storage, and a later graph saves its inputs as the tensors themselves).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from memfit._compat import StorageWeakRef
from memfit.analysis.graph import BackwardStart

__all__ = ["MATERIAL_HIGH", "MATERIAL_LOW", "StartWatch"]

#: A start that may put the plan's predicted peak below the step's by more than this share (the
#: caller held outputs, or gave gradients, the plan assumed gone) is planned again: a budget
#: must hold. The bytes of the outputs and tangents that changed bound the move.
MATERIAL_LOW = 0.01
#: A start that can only put the prediction above the step's is planned again only past this
#: share: a new capture costs the next call seconds, and the prediction is allowed 5% high.
MATERIAL_HIGH = 0.03

#: Backwards watched at most before a start unlike the plan's is believed without two in a row.
WATCHED = 4

#: The attribute of a CompiledFunction's ctx holding the watched forward's outputs.
OUTPUTS = "memfit_outputs"


class StartWatch:
    """The backward start of one compiled graph, planned and seen; see the module docstring.

    ``planned``: the start the plan assumed. ``nbytes``: bytes of each output and tangent by name
    (what a change in its status moves). ``peak``: the plan's predicted peak. ``report`` receives
    a start that differs materially.
    """

    def __init__(
        self,
        planned: BackwardStart,
        nbytes: dict[str, int],
        peak: int,
        report: Callable[[BackwardStart, bool], None],
    ) -> None:
        self.planned = planned
        self.pending = True
        self._nbytes = nbytes
        self._peak = peak
        self._report = report
        #: the forward graph's user outputs, by name (None: not a tensor), and which it also saves
        self._names: tuple[str | None, ...] = ()
        self._watched = 0  # backwards seen
        self._last: BackwardStart | None = None  # the start the last one showed
        self._saved: frozenset[int] = frozenset()

    def forward_graph(self, fw: fx.GraphModule, user_outputs: int) -> None:
        """Read the names of ``fw``'s outputs, and which it also saves for the backward."""
        output = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
        outs = list(output.args[0])
        saved = set(outs[user_outputs:])
        self._names = tuple(o.name if isinstance(o, fx.Node) else None for o in outs[:user_outputs])
        self._saved = frozenset(i for i, o in enumerate(outs[:user_outputs]) if o in saved)

    def note_forward(self, ctx: Any, outputs: Sequence[Any]) -> None:
        """The forward just returned ``outputs``: note weak references to them on ``ctx``."""
        refs = []
        for i, name in enumerate(self._names):
            t = outputs[i] if i < len(outputs) else None
            if name is None or not isinstance(t, torch.Tensor):
                continue
            storage = None if i in self._saved else StorageWeakRef(t.untyped_storage())
            refs.append((name, weakref.ref(t), storage))
        setattr(ctx, OUTPUTS, refs)

    def note_backward(self, ctx: Any, missing: frozenset[str]) -> None:
        """The backward starts with the tangents named in ``missing`` None."""
        refs = getattr(ctx, OUTPUTS, None) if ctx is not None else None
        if refs is None:
            return  # a forward not noted (run before the watch): wait for one that was
        held = set()
        for name, tensor, storage in refs:
            if tensor() is not None or (storage is not None and not storage.expired()):
                held.add(name)
        dropped = frozenset(name for name, _, _ in refs if name not in held)
        seen = BackwardStart(dropped=dropped, missing=missing)
        self._watched += 1
        if seen == self.planned:
            self.pending = False
            return
        # A start unlike the plan's is believed once two backwards in a row show it: a first
        # step can hold outputs that no later step holds (measured on Llama under "memory",
        # run after another model in the same process: every output held at the first
        # backward, none at the second), and each plan made again costs a capture.
        if seen != self._last and self._watched < WATCHED:
            self._last = seen
            return
        self.pending = False
        # held or given a gradient though the plan assumed not: the prediction may be low
        more = (self.planned.dropped - seen.dropped) | (self.planned.missing - seen.missing)
        less = (seen.dropped - self.planned.dropped) | (seen.missing - self.planned.missing)
        low = sum(self._nbytes.get(name, 0) for name in more)
        high = sum(self._nbytes.get(name, 0) for name in less)
        material = low > MATERIAL_LOW * self._peak or high > MATERIAL_HIGH * self._peak
        self._report(seen, material)
