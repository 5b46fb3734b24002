"""What each piece of a captured forward costs: profiled time, bytes created, state it reads.

The stage search needs, for every item between two candidate cuts, its time and memory. Time is
profiled, not modelled: each node of the captured graph runs once per repeat on the example
micro-batch and the median is kept (torchgpipe balances by profiled time too; a roofline of FLOPs
is off by large factors for small ops on a CPU). Backward is taken as twice the forward, the
usual ratio for matmul-dominated layers. Memory per item is the bytes of the tensors its nodes
create (views create none), what the item holds while one micro-batch's backward runs through
it with everything recomputed; and the set of parameters and buffers it reads, so a stage's
state is the union of its items' (a tied weight counted once per stage that reads it).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from memfit.execution.state import preserved
from memfit.pipeline.partition import CapturedForward, tensor_bytes

__all__ = ["ItemCosts", "measure_items"]


@dataclass(frozen=True)
class ItemCosts:
    """Per item (the nodes between consecutive ``boundaries``): time, bytes and state read."""

    boundaries: list[int]
    forward_seconds: list[float]
    activation_bytes: list[int]
    state: list[frozenset[str]]

    @property
    def count(self) -> int:
        return len(self.boundaries) - 1


class _Timer(fx.Interpreter):
    """Runs the captured graph node by node, timing each and recording the bytes it creates."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.seconds: dict[fx.Node, float] = {}
        self.created: dict[fx.Node, int] = {}

    def run_node(self, n: fx.Node) -> Any:
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        storages = {
            a.untyped_storage().data_ptr()
            for a in (*args, *kwargs.values())
            if isinstance(a, torch.Tensor)
        }
        start = time.perf_counter()
        out = getattr(self, n.op)(n.target, args, kwargs)
        self.seconds[n] = time.perf_counter() - start
        if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() not in storages:
            self.created[n] = tensor_bytes(out)
        else:
            self.created[n] = 0
        return out


def measure_items(
    captured: CapturedForward,
    placeholder_values: Sequence[Any],
    boundaries: Sequence[int],
    *,
    repeats: int = 3,
) -> ItemCosts:
    """Profile the captured forward on its example inputs and sum per item.

    ``placeholder_values`` are the graph's inputs in placeholder order (parameters and the
    example micro-batch). Buffers and random states are restored afterwards, so profiling
    leaves BatchNorm statistics and later dropout masks as they were.
    """
    runs: list[dict[fx.Node, float]] = []
    created: dict[fx.Node, int] = {}
    with preserved(captured.buffers), torch.no_grad():
        for _ in range(max(1, repeats)):
            timer = _Timer(captured.graph)
            timer.run(*placeholder_values)
            runs.append(timer.seconds)
            created = timer.created
    seconds = {node: statistics.median(run.get(node, 0.0) for run in runs) for node in runs[0]}
    forward, memory, state = [], [], []
    for start, end in zip(boundaries, boundaries[1:]):
        nodes = captured.nodes[start:end]
        forward.append(sum(seconds.get(n, 0.0) for n in nodes))
        memory.append(sum(created.get(n, 0) for n in nodes))
        names = set()
        for n in nodes:
            for a in n.all_input_nodes:
                if a in captured.state:
                    names.add(captured.state[a])
        state.append(frozenset(names))
    return ItemCosts(
        boundaries=list(boundaries),
        forward_seconds=forward,
        activation_bytes=memory,
        state=state,
    )
