"""Graph runs that drop what they keep in the forward and replay their forward in the backward:
recomputation across graph breaks (the plan: ``planning.plan_chain``).

A step with graph breaks in the model's own Python runs memfit's graphs one after the other, and
each run's autograd node (AOTAutograd's ``CompiledFunction``) keeps what its backward reads. Here
a run inside a dropped segment hands that node a 0-element placeholder instead of each value its
backward reads (parameters and buffers aside), and remembers how to make them again: its inputs,
each either a value from outside its segment (held) or output ``nr`` of an earlier run of the
same segment (not held: it is made again too), and, for a graph with random ops, the random state
it ran with. When the backward reaches a run whose values are missing, its segment's graphs run
forward again from the segment's first run, under ``no_grad`` and each with its forward's random
state, and every run of the segment gets its saved values back; its backward then runs on them
as if they had been kept. This is DTR's rematerialisation (Kirisame et al., ICLR 2021) with
Chen et al.'s segments: a value is made again from the compiled graph that made it, not by
running the user's Python again, so a branch is never decided again and nothing but the graphs'
own ops runs twice. BatchNorm's running statistics are not updated twice: under the eager
executor AOTAutograd copies the new statistics a forward returns into the buffers after the
forward, and a replay's are thrown away.

The producer of an input is its ``grad_fn``: an output of a compiled graph has the graph's
autograd node as ``grad_fn`` and its position among the graph's outputs as ``output_nr``; a
view AOTAutograd made again after the graph, or a value eager code made, has another
``grad_fn`` and is held like any value from outside the segment.

What one step's chain records is also what ``planning.plan_chain`` plans the next step from:
``StepChain.seal`` turns it into ``ChainRun``/``ChainValue`` and notes which outputs were still
alive when the forward ended although no run held them (something else holds them: eager
autograd, the caller).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from memfit._compat import StorageWeakRef, backward_keeps_graph
from memfit.analysis.graph import is_random
from memfit.execution.executors import EAGER, STATIC_INPUT
from memfit.planning.plan import GraphPlan
from memfit.planning.plan_chain import KEEP_ALL, ChainPlan, ChainRun, ChainValue, segment_cost
from memfit.planning.policy import Policy

__all__ = ["ForwardGraph", "StepChain", "chains", "recording", "restore_saved"]

#: The attribute of a CompiledFunction's ctx holding its run (``_Run``) in a step's chain.
RUN = "memfit_chain_run"

_current: StepChain | None = None


@contextlib.contextmanager
def recording(chain: StepChain | None) -> Iterator[None]:
    """Runs of memfit's forward graphs inside the block join ``chain`` (None: none does)."""
    global _current
    outer, _current = _current, chain
    try:
        yield
    finally:
        _current = outer


def chains(policy: Policy, executor: str) -> bool:
    """Whether graph runs planned under ``policy`` and run by ``executor`` may form a chain:
    where the policy chooses what to keep, and under the eager executor (an Inductor graph
    writes BatchNorm's statistics inside itself, which a replay would write again)."""
    return executor == EAGER and policy.chooses_what_to_keep


def current() -> StepChain | None:
    """The chain the forward graphs now running join, if any."""
    return _current


class ForwardGraph:
    """One compiled forward graph as a chain runs it: what its outputs are, which of its saved
    values are its parameters and buffers (never dropped) or its own inputs, and whether it
    draws random numbers (its replay must draw the same)."""

    __slots__ = (
        "compiled",
        "n_out",
        "static",
        "saved_inputs",
        "static_saved",
        "random",
        "droppable",
    )

    def __init__(
        self,
        gm: fx.GraphModule,
        compiled: Callable[[list[Any]], Any],
        n_out: int,
        droppable: bool = True,
    ) -> None:
        self.compiled = compiled
        self.n_out = n_out
        #: whether its runs may be dropped (not a graph that offloads: its transfers run once)
        self.droppable = droppable
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        position = {n: i for i, n in enumerate(placeholders)}
        self.static = frozenset(i for i, n in enumerate(placeholders) if n.meta.get(STATIC_INPUT))
        output = next(n for n in gm.graph.nodes if n.op == "output")
        saved = list(output.args[0])[n_out:]
        #: saved value -> the input it is (its position among the graph's inputs)
        self.saved_inputs = {j: position[n] for j, n in enumerate(saved) if n in position}
        self.static_saved = frozenset(j for j, i in self.saved_inputs.items() if i in self.static)
        self.random = any(is_random(n) for n in gm.graph.nodes)


@dataclass(frozen=True)
class _Out:
    """Input of a replayed run: output ``nr`` of run ``run``, made again before it."""

    run: int
    nr: int


class _Run:
    """One run of a forward graph in a step: what the backward and the planner need of it."""

    __slots__ = (
        "chain",
        "index",
        "graph",
        "plan",
        "segment",
        "inputs",
        "versions",
        "rng",
        "tokens",
        "restored",
        "sources",
        "outputs",
        "own_saved",
        "__weakref__",
    )

    def __init__(self, chain: StepChain, index: int, graph: ForwardGraph, segment: int) -> None:
        self.chain = chain
        self.index = index
        self.graph = graph
        self.plan: GraphPlan | None = None
        self.segment = segment  # the first run of its dropped segment; -1: not dropped
        self.inputs: list[Any] = []  # a dropped run's replay inputs: values and _Outs
        self.versions: list[tuple[torch.Tensor, int]] = []
        self.rng: tuple[torch.Tensor, list[tuple[int, torch.Tensor]]] | None = None
        #: (backward argument, saved value) replaced by a placeholder
        self.tokens: list[tuple[int, int]] = []
        self.restored: list[torch.Tensor] | None = None
        #: inputs other runs of the step made: (input position, producer run, output nr)
        self.sources: list[tuple[int, int, int]] = []
        #: tensor outputs: (output nr, bytes, storage)
        self.outputs: list[tuple[int, int, StorageWeakRef]] = []
        self.own_saved: set[int] = set()  # outputs its own backward reads

    def release(self) -> None:
        """Its backward has its values: let go of what a replay of it would need (its inputs
        from outside its segment, its random state). A replay for an earlier run of its segment
        stops before it."""
        self.inputs = []
        self.versions = []
        self.rng = None


_TOKEN = torch.empty(0)
#: what a CPU random state takes (``torch.get_rng_state``): a dropped random run keeps one
_RANDOM_STATE_BYTES = torch.get_rng_state().untyped_storage().nbytes()


def _random_state(args: list[Any]) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]:
    devices = {a.device.index or 0 for a in args if isinstance(a, torch.Tensor) and a.is_cuda}
    return torch.get_rng_state(), [(d, torch.cuda.get_rng_state(d)) for d in sorted(devices)]


class StepChain:
    """The runs of memfit's forward graphs in one call, and the segments they are dropped in.

    Made by the call (``execution.planned_call``) with the rule of its last plan; runs join it from
    the forward runner (``run``), and their backwards ask it for their values (``restore_saved``).
    During the call it holds its runs; once sealed, only their autograd nodes do, so the runs
    and what they hold die with the autograd graph.
    """

    def __init__(self, plan: ChainPlan = KEEP_ALL) -> None:
        self.plan = plan
        self._runs: list[_Run] = []
        self._weak: list[weakref.ref[_Run]] = []
        self._open: int | None = None  # the first run of the segment being filled
        self._spent = 0
        self._reported: GraphPlan | None = None
        self.sealed = False

    def reported(self, plan: GraphPlan) -> None:
        """The plan of the graph about to run, at the sizes it runs at (the backend's report)."""
        self._reported = plan

    def _producer(self, value: torch.Tensor) -> tuple[int, int] | None:
        """(run, output nr) of this step's run that made ``value``, if one did."""
        run = getattr(value.grad_fn, RUN, None)
        if run is None or run.chain is not self:
            return None
        nr = value.output_nr
        for made, _, storage in run.outputs:
            if made == nr:
                return (run.index, nr) if storage.cdata == value.untyped_storage()._cdata else None
        return None

    def run(
        self, ctx: Any, graph: ForwardGraph, args: list[Any], run_graph: Callable[[list[Any]], Any]
    ) -> Any:
        """Run ``graph`` on ``args`` as a run of this step: recorded, and where the rule drops it,
        with its saved values replaced by placeholders."""
        self._reported = None
        index = len(self._runs)
        drop = graph.droppable and self.plan.segment_bytes is not None and not self.sealed
        segment = -1
        if not drop:
            self._open = None
        else:
            if self._open is None:
                self._open, self._spent = index, 0
            segment = self._open
        run = _Run(self, index, graph, segment)
        for pos, a in enumerate(args):
            source = None
            if pos not in graph.static and isinstance(a, torch.Tensor) and a.grad_fn is not None:
                source = self._producer(a)
                if source is not None:
                    run.sources.append((pos, *source))
            if drop:
                if source is not None and self._runs[source[0]].segment == run.segment:
                    run.inputs.append(_Out(*source))
                    continue
                run.inputs.append(a)
                if isinstance(a, torch.Tensor) and a.grad_fn is not None:
                    run.versions.append((a, a._version))
        if drop and graph.random:
            run.rng = _random_state(args)
        outs = run_graph(args)
        run.plan = self._reported
        n_out = graph.n_out
        mine = {}
        for nr in range(n_out):
            out = outs[nr]
            if isinstance(out, torch.Tensor):
                storage = out.untyped_storage()
                run.outputs.append((nr, storage.nbytes(), StorageWeakRef(storage)))
                mine[id(out)] = nr
        saved = outs[n_out:]
        symints = 0
        while symints < len(saved) and not isinstance(saved[-1 - symints], torch.Tensor):
            symints += 1
        tensors = len(saved) - symints
        for j in range(tensors):
            own = mine.get(id(saved[j]))
            if own is not None:
                run.own_saved.add(own)
        if drop:
            outs = list(outs)
            for j in range(tensors):
                if j in graph.static_saved or isinstance(saved[j], torch.nn.Parameter):
                    continue
                outs[n_out + j] = _TOKEN
                run.tokens.append((symints + j, j))
            setattr(ctx, RUN, run)
            if run.plan is not None:
                self._spent += segment_cost(run.plan.kept_bytes, run.plan.output_bytes)
            assert self.plan.segment_bytes is not None
            if self._spent >= self.plan.segment_bytes:
                self._open = None
        elif run.sources or run.outputs:
            setattr(ctx, RUN, run)  # later runs find it as their inputs' producer
        self._runs.append(run)
        return outs

    def saved_values(self, run: _Run) -> list[torch.Tensor]:
        """``run``'s saved values that its forward replaced by placeholders, made again."""
        if run.restored is None:
            self._replay(run.segment, run.index)
        values, run.restored = run.restored, None
        assert values is not None
        return values

    def _replay(self, first: int, last: int) -> None:
        """Run the graphs of runs ``first`` to ``last`` forward again, each on the outputs the
        runs before it just made, and give each run its saved values back."""
        runs = []
        for i in range(first, last + 1):
            run = self._runs[i] if not self.sealed else self._weak[i]()
            if run is None:
                raise RuntimeError(
                    "memfit: a graph run this backward must replay was freed: the backward of a "
                    "step with graph breaks ran after parts of its autograd graph were released"
                )
            runs.append(run)
        last_read: dict[tuple[int, int], int] = {}
        for run in runs:
            for a in run.inputs:
                if isinstance(a, _Out):
                    last_read[(a.run, a.nr)] = run.index
        made: dict[tuple[int, int], torch.Tensor] = {}
        for run in runs:
            for tensor, version in run.versions:
                if tensor._version != version:
                    raise RuntimeError(
                        "one of the variables needed for gradient computation has been modified "
                        "by an inplace operation: memfit replays a graph of this step from it in "
                        f"the backward (run {run.index}), and it has changed since the forward "
                        f"(version {tensor._version}, expected {version})"
                    )
            args = [made[(a.run, a.nr)] if isinstance(a, _Out) else a for a in run.inputs]
            for a in args:
                if isinstance(a, torch.Tensor) and a.numel() and not a.untyped_storage().nbytes():
                    raise RuntimeError(
                        "memfit: a graph run this backward replays (across a graph break) reads "
                        "a tensor whose storage was freed since the forward (a parameter FSDP "
                        "resharded?); apply memfit to each sharded block instead, or use "
                        "policy='speed' for this model"
                    )
            with torch.no_grad(), _with_random_state(run.rng):
                outs = run.graph.compiled(args)
            n_out = run.graph.n_out
            if run.restored is None:
                run.restored = [outs[n_out + j] for _, j in run.tokens]
            for nr, _, _ in run.outputs:
                if last_read.get((run.index, nr), -1) > run.index:
                    made[(run.index, nr)] = outs[nr]
            del outs
            for key in [k for k, reader in last_read.items() if reader == run.index]:
                made.pop(key, None)

    def seal(self) -> tuple[list[ChainRun], list[ChainValue]]:
        """End the forward: the runs and values as ``planning.plan_chain`` plans them; from now on
        only the runs' autograd nodes hold the runs."""
        facts = self._facts()
        self._weak = [weakref.ref(r) for r in self._runs]
        self._runs = []
        self.sealed = True
        return facts

    def _facts(self) -> tuple[list[ChainRun], list[ChainValue]]:
        runs = []
        for r in self._runs:
            p = r.plan
            if p is None:  # a run the backend did not report: no numbers to plan it with
                return [], []
            runs.append(
                ChainRun(
                    key=p.sized_key,
                    forward_peak=p.forward_peak_bytes or p.predicted_peak_bytes,
                    backward_peak=p.backward_peak_bytes or p.predicted_peak_bytes,
                    kept=p.kept_bytes,
                    parameter_grads=p.parameter_grad_bytes,
                    forward_flops=p.forward_flops,
                    output_bytes=p.output_bytes,
                    droppable=r.graph.droppable,
                    random_state_bytes=_RANDOM_STATE_BYTES if r.graph.random else 0,
                )
            )
        readers: dict[tuple[int, int], list[int]] = {}
        savers: dict[tuple[int, int], list[int]] = {}
        for r in self._runs:
            saved_positions = set(r.graph.saved_inputs.values())
            for pos, producer, nr in r.sources:
                readers.setdefault((producer, nr), []).append(r.index)
                if pos in saved_positions:
                    savers.setdefault((producer, nr), []).append(r.index)
        values = []
        for r in self._runs:
            for nr, nbytes, storage in r.outputs:
                key = (r.index, nr)
                read = readers.get(key, [])
                save = ([r.index] if nr in r.own_saved else []) + savers.get(key, [])
                dropped = r.segment >= 0
                held = [c for c in save if self._runs[c].segment < 0] + [
                    c
                    for c in read
                    if self._runs[c].segment >= 0
                    and (not dropped or self._runs[c].segment != r.segment)
                ]
                pinned = not storage.expired() and not held
                if read or save or pinned:
                    values.append(
                        ChainValue(r.index, nbytes, tuple(read), tuple(save), pinned=pinned)
                    )
        return runs, values


@contextlib.contextmanager
def _with_random_state(
    state: tuple[torch.Tensor, list[tuple[int, torch.Tensor]]] | None,
) -> Iterator[None]:
    if state is None:
        yield
        return
    cpu, cuda = state
    with torch.random.fork_rng(devices=[d for d, _ in cuda]):
        torch.set_rng_state(cpu)
        for device, value in cuda:
            torch.cuda.set_rng_state(value, device)
        yield


def restore_saved(ctx: Any, args: list[Any]) -> None:
    """Before a compiled backward runs: put back the saved values its forward dropped."""
    run = getattr(ctx, RUN, None)
    if run is None or not run.tokens:
        return
    for (position, _), value in zip(run.tokens, run.chain.saved_values(run)):
        args[position] = value
    if not backward_keeps_graph():
        # Autograd keeps a node until the whole backward ends; what it replays from need not.
        run.release()
