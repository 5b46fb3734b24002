"""The ``torch.compile`` backend that applies memfit plans.

Dynamo captures each graph-break-free piece of the model; AOTAutograd traces its joint
forward/backward graph and hands it to the partitioner (``execution.partitioner``), where memfit
prepares it (``capture.passes``), measures its ops' scratch memory, plans it and splits it by the
plan. The order is the point: every rewrite that changes what can be decided runs before
analysis, so the plan describes exactly the graphs that run and nothing is patched afterwards.

This module wires the pieces together: each Dynamo graph rewritten (dropouts, attention) and
named before AOTAutograd traces it, the partitioner, and the compilers that report each planned
graph's runs. How the split graphs then run is ``execution.runners``; under
``executor="inductor"`` a plan is compiled and fitted to its budget by
``execution.inductor_fit``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from memfit._compat import aot_autograd
from memfit.analysis.graph import BackwardStart
from memfit.capture.attention import Attention, replace_attention
from memfit.capture.dropout import remove_identity_dropouts
from memfit.capture.loss_head import LossHead, replace_loss_heads
from memfit.execution.chain import chains
from memfit.execution.executors import (
    EAGER,
    INDUCTOR,
    check_executor,
    decompositions,
)
from memfit.execution.offload import Offloader, OffloadOptions
from memfit.execution.partitioner import Partitioner, StepBudget
from memfit.execution.runners import (
    PLAN_META,
    SIZES_META,
    boxed,
    boxed_backward,
    boxed_forward,
)
from memfit.execution.symbolic import PlansBySize
from memfit.planning.plan import GraphPlan
from memfit.planning.policy import Policy
from memfit.planning.step_budget import GraphShare

__all__ = ["make_backend"]


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
    the offloader's, the wrapper told (``on_run``, ``on_backward``, ``on_budget_miss``)."""

    executor: str
    chained: bool
    step_budget: StepBudget | None
    offloader: Offloader | None
    on_run: Callable[[GraphPlan], None] | None
    on_budget_miss: Callable[[GraphPlan], None] | None
    on_backward: Callable[[GraphPlan], None] | None

    def forward(self, gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        planned: GraphPlan | None = gm.meta.get(PLAN_META)
        if planned is None:  # not partitioned by memfit: no plan to report
            return boxed_forward(gm, example_inputs, executor=self.executor)
        plan: GraphPlan = planned
        by_size: PlansBySize | None = gm.meta.get(SIZES_META)
        read_sizes = by_size.reader(gm) if by_size is not None else None
        step_budget, offloader = self.step_budget, self.offloader
        on_run, on_budget_miss = self.on_run, self.on_budget_miss

        def ran(args: list[Any]) -> None:
            this = plan
            if by_size is not None and read_sizes is not None:
                this = by_size.at(read_sizes(args))
                spent = step_budget.spent if step_budget is not None else 0
                if on_budget_miss is not None and by_size.over_budget(this, spent_bytes=spent):
                    on_budget_miss(this)
            # What this graph keeps (and offloads) is alive while the step's later graphs run.
            if step_budget is not None:
                step_budget.spent += this.kept_bytes
            if offloader is not None and this.transfers:
                offloader.spent += this.offloaded_bytes
            if on_run is not None:
                on_run(this)

        return boxed_forward(
            gm, example_inputs, on_run=ran, executor=self.executor, chained=self.chained
        )

    def backward(self, gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        planned: GraphPlan | None = gm.meta.get(PLAN_META)
        if planned is None or self.on_backward is None:
            return boxed_backward(gm, example_inputs, executor=self.executor)
        plan: GraphPlan = planned
        report = self.on_backward
        return boxed_backward(
            gm, example_inputs, on_run=lambda args: report(plan), executor=self.executor
        )


@dataclass(eq=False)  # hashed by identity, as Dynamo keeps backends
class _Backend:
    """The Dynamo backend ``make_backend`` returns: each graph Dynamo hands it is named, its
    attention and loss head rewritten, then planned and compiled by AOTAutograd."""

    partition: Partitioner
    compile_joint: Callable[..., Any]
    attention: str
    loss_head: str
    on_compile: Callable[[], None] | None
    #: what Dynamo's logs call the backend
    __name__ = "memfit"

    def __call__(self, gm: fx.GraphModule, example_inputs: Any) -> Any:
        if self.on_compile is not None:
            self.on_compile()
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
        if self.attention == "auto":
            self.partition.sites.extend(replace_attention(gm))
        if self.loss_head == "auto":
            self.partition.loss_heads.extend(replace_loss_heads(gm))
        return self.compile_joint(gm, example_inputs)


def make_backend(
    policy: Policy,
    on_plan: Callable[[GraphPlan], None],
    step_budget: StepBudget | None = None,
    attention: str = "auto",
    offloader: Offloader | None = None,
    on_run: Callable[[GraphPlan], None] | None = None,
    on_backward: Callable[[GraphPlan], None] | None = None,
    outside_bytes: Callable[[str, int], int] | None = None,
    share: Callable[[str], GraphShare | None] | None = None,
    on_compile: Callable[[], None] | None = None,
    on_budget_miss: Callable[[GraphPlan], None] | None = None,
    executor: str = EAGER,
    on_unmeasured: Callable[[], None] | None = None,
    backward_start: Callable[[str], BackwardStart | None] | None = None,
    on_backward_start: Callable[[str, BackwardStart, bool], None] | None = None,
    chain_mode: Callable[[], tuple[bool, int | None] | None] | None = None,
    loss_head: str = "auto",
) -> Callable[..., Any]:
    """A Dynamo backend planning every joint graph with ``policy``; reports each plan.

    ``on_plan`` receives each graph's plan when it is made; ``on_run`` receives it every time
    the graph's forward runs afterwards, so a wrapper can say which plans the call it just made
    ran (Dynamo reuses a graph compiled earlier without calling the backend again), and
    ``on_backward`` every time its backward starts. ``outside_bytes(key, output_bytes)`` is what
    the step holds outside the graph ``key`` names (``GraphPlan.key``) between its forward and
    backward, when the graph's outputs take ``output_bytes``; the plan reserves it.
    ``share(key)``, once a step with graph breaks has been planned as a whole
    (``planning.step_budget``), is the graph's share of the step's budget at the sizes ``key`` names
    (``GraphPlan.sized_key``); before that (None), each graph is planned as the step's first
    call reaches it. ``on_compile`` is called as Dynamo hands the backend a graph, before
    anything else (the wrapper looks at which modules are running eagerly then:
    ``execution.regions``).

    A graph captured with symbolic sizes (a dimension that varied between calls) is planned once
    at the sizes of the call captured, for the range of sizes its decisions hold for (guards of
    the capture: a size outside is captured again), and ``on_run`` receives, for every call,
    the plan at the sizes that call ran (NOTE [One capture for many sizes] in
    ``planning.resize``); ``on_budget_miss`` receives it where the budget does not hold at
    those sizes (between the sizes the range was checked at), for the wrapper to plan again.
    ``on_unmeasured`` is called where a graph compiled by Inductor could not be measured because
    a CPU profiler session was running (a ``memfit.measure`` around the first call): its peaks
    are then Inductor's schedule's estimate, and the wrapper plans again, measured, on its first
    call outside such a session.

    ``backward_start(key)`` is the start of the backward of graph ``key`` seen on an earlier
    step (which outputs the caller held, which got no gradient: ``analysis.backward_start``);
    None: it is assumed. ``on_backward_start(key, seen, material)`` receives, at each planned
    graph's first backward, the start seen there where it differs from the one planned for, and
    whether it differs by enough to plan again (``execution.start_watch``). ``chain_mode()``:
    how graphs that run as a chain (``planning.chain``) are planned (``Partitioner``'s).

    With ``attention="auto"`` every attention in the Dynamo graph is first rewritten to a kernel
    that keeps no Lq x Lk tensor (``capture.attention``); the sites found are reported on the
    graph's plan. With ``loss_head="auto"`` every ``cross_entropy(linear(h))`` is rewritten to
    a kernel that never builds the logits for the loss (``capture.loss_head``), reported
    likewise. A policy that offloads needs an ``offloader``.
    """
    Attention.parse(attention, "attention", "memfit.Attention")
    LossHead.parse(loss_head, "loss_head", "memfit.LossHead")
    check_executor(executor)
    if policy.offload and offloader is None:
        offloader = Offloader(OffloadOptions())
    chained = chains(policy, executor)  # runs of a step may be dropped and replayed
    partition = Partitioner(
        policy,
        on_plan,
        executor=executor,
        step_budget=step_budget,
        offloader=offloader,
        outside_bytes=outside_bytes,
        share=share,
        on_unmeasured=on_unmeasured,
        backward_start=backward_start,
        on_backward_start=on_backward_start,
        chain_mode=chain_mode,
    )

    runs = _RunReports(
        executor, chained, step_budget, offloader, on_run, on_budget_miss, on_backward
    )

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

    return _Backend(partition, compile_joint, attention, loss_head, on_compile)
