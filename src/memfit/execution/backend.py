"""The ``torch.compile`` backend that applies memfit plans.

Dynamo captures each graph-break-free piece of the model; AOTAutograd traces its joint
forward/backward graph and hands it to ``partition``, where memfit prepares it
(``capture.passes``), measures its ops' scratch memory, plans it and splits it by the plan. The
order is the point: every rewrite that changes what can be decided runs before analysis, so the
plan describes exactly the graphs that run and nothing is patched afterwards.

The compiled graphs run as plain FX code (no Inductor), op for op the kernels eager PyTorch would
call, which is what keeps losses and gradients equal to plain PyTorch. Compilers are "boxed" so
the backward graph receives its saved tensors in a list it may clear: a saved value is freed
after its last use in backward instead of living until the whole backward ends.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from memfit._compat import (
    aot_autograd,
    boxed_codegen,
    compiled_function_ctx,
    disable_current_modes,
)
from memfit.analysis.graph import JointGraph, node_tensors
from memfit.analysis.op_scratch import measure_op_scratch
from memfit.analysis.transfers import Link
from memfit.capture.attention import ATTENTION_MODES, AttentionSite, replace_attention
from memfit.capture.dropout import remove_identity_dropouts
from memfit.capture.mark import strip_marks
from memfit.capture.passes import prepare_joint_graph
from memfit.execution.offload import OffloadOptions, OffloadStore, copy_overlap, measure_link
from memfit.execution.partition import split_joint_graph
from memfit.execution.tangents import tangent_positions, without_tangents
from memfit.planning.plan import GraphPlan
from memfit.planning.planner import plan_graph
from memfit.planning.policy import Policy

__all__ = ["make_backend", "Offloader", "StepBudget"]


def _boxed(gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
    """Run ``gm`` with the boxed convention *and* let it drop each input after its last use.

    ``make_boxed_func`` alone keeps the argument list alive for the whole call, so every saved
    tensor would live until the backward graph ends. FX's boxed code generator emits code that
    unpacks and clears the list first; then a saved value dies right after its last reader, as
    the simulator assumes (measured: without this, ``"none"`` peaked 5-20% above eager).
    """
    strip_marks(gm)  # inference graphs (no_grad calls) still contain marks: drop them
    gm.graph.set_codegen(boxed_codegen())
    gm.recompile()

    def run(args: list[Any]) -> Any:
        return gm(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _boxed_forward(gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
    """``_boxed``, and the outputs the loss does not read get no gradient, as in eager.

    By default autograd hands an ``autograd.Function`` zeros for every output that got no
    gradient; turning that off lets the backward skip them (``execution.tangents``).
    """
    run_graph = _boxed(gm, example_inputs)

    def run(args: list[Any]) -> Any:
        ctx = compiled_function_ctx()
        if ctx is not None:
            ctx.set_materialize_grads(False)
        return run_graph(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _boxed_backward(gm: fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
    """``_boxed``, specialized to the tangents that arrive as None (``execution.tangents``)."""
    tangents = tangent_positions(gm)
    graphs: dict[frozenset[str], Callable[..., Any]] = {frozenset(): _boxed(gm, example_inputs)}

    def run(args: list[Any]) -> Any:
        missing = frozenset(name for i, name in tangents if args[i] is None)
        if missing not in graphs:
            graphs[missing] = _boxed(without_tangents(gm, set(missing)), example_inputs)
        return graphs[missing](args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _largest_value(jg: JointGraph) -> int:
    return max(jg.storage_bytes.values(), default=0)


@dataclasses.dataclass
class StepBudget:
    """What the graphs of one training step have kept so far, for a byte budget shared by them.

    With graph breaks, the graphs of one step are planned one after the other as the step first
    runs; values kept by earlier graphs stay alive while later ones run, so each graph gets the
    budget less what the graphs before it keep. The wrapper resets ``spent`` at every call.
    """

    spent: int = 0


class Offloader:
    """The offload side of one wrapper: its options, its stores and the link it plans with.

    A store is made when the first graph offloading to its destination is planned (the
    destination depends on the device the activations are on) and lives as long as the wrapper;
    graphs of one model on different devices each keep theirs. ``spent`` is what the graphs of
    the current step offload, so the host budget and the disk's free space bound the step, not
    each graph (the wrapper resets it at every call, as it does the step budget).
    """

    def __init__(self, options: OffloadOptions) -> None:
        self.options = options
        self.stores: dict[str, OffloadStore] = {}
        self.store: OffloadStore | None = None  # the store of the graph planned last
        self.spent = 0

    def prepare(self, jg: JointGraph) -> tuple[Link, str, int | None]:
        """The link, destination and byte limit the planner offloads ``jg``'s values with."""
        device = _activation_device(jg)
        to = self.options.destination(device)
        if to not in self.stores:
            self.stores[to] = OffloadStore(to, self.options.directory)
        self.store = self.stores[to]
        limits = [self.options.host_budget_bytes]
        free = self.store.free_disk_bytes()
        if free is not None:
            limits.append(int(0.9 * free))
        limit = min((n for n in limits if n is not None), default=None)
        if limit is not None:
            limit = max(limit - self.spent, 0)
        if self.options.bandwidth is not None:
            bandwidth = self.options.bandwidth
            return Link(bandwidth, bandwidth, overlap=copy_overlap(device)), to, limit
        with disable_current_modes():  # the partitioner traces under fake tensors: measure real
            return measure_link(to, device, self.options.directory), to, limit

    def planned(self, plan: GraphPlan) -> None:
        """Count ``plan``'s offload against the step and hold host memory for it."""
        if not plan.transfers or self.store is None:
            return
        self.spent += plan.offloaded_bytes
        with disable_current_modes():  # a real pinned arena, not a fake tensor
            self.store.reserve([t.nbytes for t in plan.transfers])


def _activation_device(jg: JointGraph) -> torch.device:
    for n in jg.forward:
        for t in node_tensors(n):
            return t.device
    return torch.device("cpu")


def make_backend(
    policy: Policy,
    on_plan: Callable[[GraphPlan], None],
    step_budget: StepBudget | None = None,
    attention: str = "auto",
    offloader: Offloader | None = None,
) -> Callable[..., Any]:
    """A Dynamo backend planning every joint graph with ``policy``; reports each plan.

    With ``attention="auto"`` every attention in the Dynamo graph is first rewritten to a kernel
    that keeps no Lq x Lk tensor (``capture.attention``); the sites found are reported on the
    graph's plan. A policy that offloads needs an ``offloader``.
    """
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
    if policy.offload and offloader is None:
        offloader = Offloader(OffloadOptions())
    sites: list[AttentionSite] = []

    def partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        prepare_joint_graph(joint)
        jg = JointGraph(joint, kwargs["num_fwd_outputs"])
        jg.op_scratch = measure_op_scratch(jg.nodes, min_bytes=_largest_value(jg) // 64)
        link, to, limit = (
            offloader.prepare(jg) if policy.offload and offloader else (None, None, None)
        )
        graph_plan = plan_graph(
            jg,
            policy,
            spent_bytes=step_budget.spent if step_budget else 0,
            link=link,
            offload_to=to,
            offload_min_bytes=offloader.options.min_bytes if offloader else 1,
            offload_limit_bytes=limit,
        )
        graph_plan = dataclasses.replace(graph_plan, attention=tuple(sites))
        if step_budget is not None:
            step_budget.spent += graph_plan.kept_bytes
        on_plan(graph_plan)
        if offloader is not None:
            offloader.planned(graph_plan)
        return split_joint_graph(
            joint,
            graph_plan,
            num_fwd_outputs=kwargs["num_fwd_outputs"],
            static_lifetime_input_indices=kwargs.get("static_lifetime_input_indices"),
            store=offloader.store if offloader else None,
        )

    compile_joint = aot_autograd(
        fw_compiler=_boxed_forward,
        bw_compiler=_boxed_backward,
        inference_compiler=_boxed,
        partition_fn=partition,
    )

    def backend(gm: fx.GraphModule, example_inputs: Any) -> Any:
        sites.clear()
        remove_identity_dropouts(gm)  # eager makes no copy for them; AOTAutograd would
        if attention == "auto":
            sites.extend(replace_attention(gm))
        return compile_joint(gm, example_inputs)

    return backend
