"""What each piece of a captured forward costs: profiled time, bytes created, state it reads.

The stage search needs, for every item between two candidate cuts, its time and memory. Time is
profiled, not modelled: each node of the captured graph runs once per repeat on the example
micro-batch and its least time is kept (NOTE [A node's least time]; torchgpipe balances by
profiled time too; a roofline of FLOPs is off by large factors for small ops on a CPU). Backward
is taken as twice the forward, the usual ratio for matmul-dominated layers. Memory per item is
the bytes of the tensors its nodes create (views create none), what the item holds while one
micro-batch's backward runs through it with everything recomputed; and the set of parameters
and buffers it reads, so a stage's state is the union of its items' (a tied weight counted once
per stage that reads it).

``prepare_search`` does all of it once per model (capture, candidate cuts, profiling) and keeps
the result, with the bytes crossing every cut, as the ``Search`` the cut search and every
stage's plan read.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from memfit.execution.state import preserved
from memfit.pipeline.partition import (
    CapturedForward,
    capture_forward,
    crossing_bytes,
    item_boundaries,
    tensor_bytes,
)
from memfit.planning.plan import Plan

__all__ = [
    "TRAINING_FACTOR",
    "ItemCosts",
    "Search",
    "measure_items",
    "prepare_search",
    "state_bytes",
]

#: forward + backward as a multiple of the forward alone (backward ~ 2x forward)
TRAINING_FACTOR = 3.0

#: runs of the captured forward whose least time per node is kept (NOTE [A node's least time])
REPEATS = 5

# NOTE [A node's least time]
# Load from other processes only ever adds time, and it comes in bursts: a thread descheduled in
# the middle of an op makes a parallel region wait a whole time slice (20-50 ms where the op
# takes 50 us on 2 busy cores), and a burst covers a stretch of consecutive ops in one run. The
# median of three runs keeps such a stretch whenever two runs are hit (one stage of a balanced
# cut then reads 968 ms beside 23 and 76); the least of five runs is hit only when all five are.
# On a 2-core machine at load 5-6, the captured 4-block GPT-2 of ``examples/pipeline_gpt2.py``
# cut in two 12 times, each time from five fresh runs: the median of the first three chose 9
# different cuts, the worst 47.5% slower (by the least times over all 60 runs) than the best;
# the least of the five chose 3, the worst within 3.0% of the best, the best 10 times of 12.
# Under load so heavy that no run is clean (load 8 on 2 cores, every op 100x slower), no
# estimate is stable.


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
    repeats: int = REPEATS,
) -> ItemCosts:
    """Profile the captured forward on its example inputs and sum per item.

    ``placeholder_values`` are the graph's inputs in placeholder order (parameters and the
    example micro-batch). Each node's time is its least over ``repeats`` runs (NOTE [A node's
    least time]). Buffers and random states are restored afterwards, so profiling leaves
    BatchNorm statistics and later dropout masks as they were.
    """
    runs: list[dict[fx.Node, float]] = []
    created: dict[fx.Node, int] = {}
    with preserved(captured.buffers), torch.no_grad():
        for _ in range(max(1, repeats)):
            timer = _Timer(captured.graph)
            timer.run(*placeholder_values)
            runs.append(timer.seconds)
            created = timer.created
    seconds = {node: min(run.get(node, 0.0) for run in runs) for node in runs[0]}
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


@dataclass
class Search:
    """The captured forward and its profiled items: what the cut search reads.

    Made once per model and micro-batch (``prepare_search``: capture, candidate cuts,
    profiling); the search, the split and every stage's plan read it. ``stage_plans`` keeps
    memfit's plans of stage spans (``stage_planner``), which do not depend on the schedule.
    """

    captured: CapturedForward
    costs: ItemCosts
    crossing: list[int]
    output_bytes: int
    stage_plans: dict[tuple[Any, ...], Plan] = field(default_factory=dict)


def prepare_search(
    model: nn.Module, micro: tuple[Any, ...], max_items: int, repeats: int = REPEATS
) -> Search:
    """Capture ``model`` on one micro-batch, choose candidate cuts, profile the items.

    ``repeats``: profiled runs (each node's least time is kept); 1 when the times will come
    from elsewhere (ranks other than 0 take rank 0's).
    """
    captured = capture_forward(model, micro)
    boundaries = item_boundaries(captured, max_items)
    costs = measure_items(captured, captured.placeholder_values, boundaries, repeats=repeats)
    output_node = next(iter(captured.graph.graph.find_nodes(op="output")))
    outputs = [a for a in output_node.all_input_nodes]
    output_bytes = sum(tensor_bytes(a.meta.get("example_value")) for a in outputs)
    return Search(captured, costs, crossing_bytes(captured), output_bytes)


def state_bytes(
    search: Search, names: set[str] | frozenset[str], optimizer_state: float
) -> tuple[int, int, int]:
    """Bytes of the parameters, the buffers and the optimizer state among ``names``."""
    params = sum(
        tensor_bytes(search.captured.tensors[n])
        for n in names
        if n in search.captured.parameter_names
    )
    buffers = sum(
        tensor_bytes(search.captured.tensors[n])
        for n in names
        if n not in search.captured.parameter_names
    )
    return params, buffers, int(optimizer_state * params)
