"""The ``torch.compile`` backend that applies memfit plans.

Dynamo captures each graph-break-free piece of the model; AOTAutograd traces its joint
forward/backward graph and hands it to the partitioner (``execution.partitioner``), where memfit
prepares it (``capture.passes``), measures its ops' scratch memory, plans it and splits it by the
plan. The order is the point: every rewrite that changes what can be decided runs before
analysis, so the plan describes exactly the graphs that run and nothing is patched afterwards.

This module wires the pieces together: each Dynamo graph rewritten (dropouts, attention) and
named before AOTAutograd traces it, the partitioner, and the compilers that report each planned
graph's runs. A backend is made from two things: ``BackendSettings`` (``execution.settings``:
the policy, executor, rewrites, offloader and step budget, the one object holding the policy)
and ``BackendEvents`` (``execution.events``: the one interface it reports to and asks, a call's
session). How the split graphs then run is ``execution.runners``; under
``executor="inductor"`` a plan is compiled and fitted to its budget by
``execution.inductor_fit``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx as fx

from memfit._compat import aot_autograd
from memfit.capture.attention import Attention, replace_attention
from memfit.capture.dropout import remove_identity_dropouts
from memfit.capture.loss_head import LossHead, replace_loss_heads
from memfit.execution.events import BackendEvents
from memfit.execution.executors import INDUCTOR, check_executor, decompositions
from memfit.execution.offload import Offloader, OffloadOptions
from memfit.execution.partitioner import Partitioner
from memfit.execution.run_chain import chains
from memfit.execution.runners import (
    PLAN_META,
    SIZES_META,
    boxed,
    boxed_backward,
    boxed_forward,
)
from memfit.execution.settings import BackendSettings
from memfit.execution.symbolic import PlansBySize
from memfit.planning.plan import GraphPlan

__all__ = ["BackendEvents", "BackendSettings", "make_backend"]


def graph_key(gm: fx.GraphModule, example_inputs: Any) -> str:
    """A name for a Dynamo graph and its inputs' shapes, the same each time it is captured.

    Where a size is a symbol, the key has the symbol, not the size of the call captured: a graph
    captured again for another range of sizes (after planning again) keeps its name, and with it
    what was measured while its previous capture ran.
    """
    parts = [gm.code]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    examples = [n.meta.get("example_value") for n in placeholders]
    if len(examples) == len(example_inputs) and all(e is not None for e in examples):
        example_inputs = examples  # fake values: symbolic sizes as symbols
    for t in example_inputs:
        if isinstance(t, torch.Tensor):
            parts.append(f"{t.dtype}{tuple(t.shape)}{t.stride()}{t.device}{t.requires_grad}")
        else:
            parts.append(repr(t))
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:16]


@dataclass(eq=False)  # hashed by identity, as the functions Dynamo and AOTAutograd keep
class _RunReports:
    """How the compiled forward and backward of a planned graph report each run: the plan at
    the sizes the call ran (a symbolic capture), what it keeps spent from the step's budget and
    the offloader's, the call told (``graph_ran``, ``backward_started``, ``budget_missed``)."""

    settings: BackendSettings
    events: BackendEvents
    chained: bool

    def forward(self, gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        executor = self.settings.executor
        planned: GraphPlan | None = gm.meta.get(PLAN_META)
        if planned is None:  # not partitioned by memfit: no plan to report
            return boxed_forward(gm, example_inputs, executor=executor)
        plan: GraphPlan = planned
        by_size: PlansBySize | None = gm.meta.get(SIZES_META)
        read_sizes = by_size.reader(gm) if by_size is not None else None
        step_budget, offloader = self.settings.step_budget, self.settings.offloader
        events = self.events

        def ran(args: list[Any]) -> None:
            this = plan
            if by_size is not None and read_sizes is not None:
                this = by_size.at(read_sizes(args))
                spent = step_budget.spent if step_budget is not None else 0
                if by_size.over_budget(this, spent_bytes=spent):
                    events.budget_missed(this)
            # What this graph keeps (and offloads) is alive while the step's later graphs run.
            if step_budget is not None:
                step_budget.spent += this.kept_bytes
            if offloader is not None and this.transfers:
                offloader.spent += this.offloaded_bytes
            events.graph_ran(this)

        return boxed_forward(
            gm, example_inputs, on_run=ran, executor=executor, chained=self.chained
        )

    def backward(self, gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        executor = self.settings.executor
        planned: GraphPlan | None = gm.meta.get(PLAN_META)
        if planned is None:
            return boxed_backward(gm, example_inputs, executor=executor)
        plan: GraphPlan = planned
        report = self.events.backward_started
        return boxed_backward(
            gm, example_inputs, on_run=lambda args: report(plan), executor=executor
        )


@dataclass(eq=False)  # hashed by identity, as Dynamo keeps backends
class _Backend:
    """The Dynamo backend ``make_backend`` returns: each graph Dynamo hands it is named, its
    attention and loss head rewritten, then planned and compiled by AOTAutograd."""

    partition: Partitioner
    compile_joint: Callable[..., Any]
    settings: BackendSettings
    events: BackendEvents
    #: what Dynamo's logs call the backend
    __name__ = "memfit"

    def __call__(self, gm: fx.GraphModule, example_inputs: Any) -> Any:
        self.events.compiling()
        self.partition.sites.clear()
        self.partition.loss_heads.clear()
        self.partition.key = graph_key(gm, example_inputs)
        # AOTAutograd's primals: the module's parameters and buffers, then Dynamo's inputs
        # (aot_module_simplified, checked 2.13.0); real values, which the Inductor executor runs
        # its compiled graphs on once to measure them.
        self.partition.primals = [
            *dict(gm.named_parameters(remove_duplicate=False)).values(),
            *dict(gm.named_buffers(remove_duplicate=False)).values(),
            *example_inputs,
        ]
        remove_identity_dropouts(gm)  # eager makes no copy for them; AOTAutograd would
        if self.settings.attention == "auto":
            self.partition.sites.extend(replace_attention(gm))
        if self.settings.loss_head == "auto":
            self.partition.loss_heads.extend(replace_loss_heads(gm))
        return self.compile_joint(gm, example_inputs)


def make_backend(settings: BackendSettings, events: BackendEvents) -> Callable[..., Any]:
    """A Dynamo backend planning every joint graph by ``settings``, reporting to ``events``.

    ``events`` (``execution.events.BackendEvents``) receives each graph's plan when it is made,
    and every time the graph's forward runs afterwards (Dynamo reuses a graph compiled earlier
    without calling the backend again), so a call can say which plans it ran; and it is asked,
    as each graph is planned, what the step holds around the graph (outside it between forward
    and backward, its share of a step planned as a whole, the start of its backward seen on an
    earlier step, how a chain plans it).

    A graph captured with symbolic sizes (a dimension that varied between calls) is planned once
    at the sizes of the call captured, for the range of sizes its decisions hold for (guards of
    the capture: a size outside is captured again), and every run reports the plan at the sizes
    it ran at (NOTE [One capture for many sizes] in ``planning.resize``).

    With ``attention="auto"`` every attention in the Dynamo graph is first rewritten to a kernel
    that keeps no Lq x Lk tensor (``capture.attention``); the sites found are reported on the
    graph's plan. With ``loss_head="auto"`` every ``cross_entropy(linear(h))`` is rewritten to
    a kernel that never builds the logits for the loss (``capture.loss_head``), reported
    likewise. A policy that offloads without an offloader gets one with default options.
    """
    Attention.parse(settings.attention, "attention", "memfit.Attention")
    LossHead.parse(settings.loss_head, "loss_head", "memfit.LossHead")
    check_executor(settings.executor)
    if settings.policy.offload and settings.offloader is None:
        settings = replace(settings, offloader=Offloader(OffloadOptions()))
    executor = settings.executor
    partition = Partitioner(settings, events)
    # runs of a step may be dropped and replayed
    runs = _RunReports(settings, events, chained=chains(settings.policy, executor))

    def compile_inference(gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        return boxed(gm, example_inputs, executor=executor)

    compile_joint = aot_autograd(
        fw_compiler=runs.forward,
        bw_compiler=runs.backward,
        inference_compiler=compile_inference,
        partition_fn=partition,
        decompositions=decompositions(executor),
        # Under Inductor, as torch.compile's own AOTAutograd call (compile_fx, checked 2.13.0):
        # an input the forward writes (BatchNorm's running statistics) is written inside the
        # compiled graph, fused into the kernel that computes it, instead of being returned and
        # copied back by AOTAutograd's wrapper: on the frontier's ResNet, 75 fewer buffers and
        # 75 fewer copy_ calls per step. The eager executor keeps eager's ops as they are.
        keep_inference_input_mutations=executor == INDUCTOR,
    )

    return _Backend(partition, compile_joint, settings, events)
