"""Turn a policy into a ``GraphPlan`` for one joint graph, with its predicted memory and cost.

The guard against the failure the original tool had (checkpoints that used *more* memory than
none) lives here: the automatic policies are compared with the plain plan in the simulator and
fall back to it when they would not save anything.
"""

from __future__ import annotations

import torch.fx as fx

from memfit.analysis.cost import node_flops
from memfit.analysis.graph import JointGraph
from memfit.analysis.simulate import simulate_step
from memfit.planning.plan import GraphPlan
from memfit.planning.policies import POLICIES, keep_all

__all__ = ["plan_graph", "AUTOMATIC_POLICIES"]

AUTOMATIC_POLICIES = ("memory", "speed")


def plan_graph(jg: JointGraph, policy: str) -> tuple[set[fx.Node], set[fx.Node], GraphPlan]:
    """Choose what to keep in ``jg`` under ``policy``.

    Returns the kept nodes, the forward nodes the backward recomputes, and the plan summary.
    """
    baseline = keep_all(jg)
    base_sim = simulate_step(jg, baseline)
    kept = baseline if policy == "none" else POLICIES[policy](jg)
    sim = simulate_step(jg, kept)
    note = ""
    if policy in AUTOMATIC_POLICIES and sim.peak_bytes > base_sim.peak_bytes:
        note = (f"{policy!r} would peak above plain autograd here "
                f"({sim.peak_bytes} > {base_sim.peak_bytes} B): kept everything instead")
        kept, sim = baseline, base_sim
    forward_set = set(jg.forward)
    recomputed = [n for n in sim.backward if n in forward_set]
    # What the plan reports as kept: activations held for backward beyond what the step returns
    # anyway (its outputs) and what existed before it (parameters, inputs).
    outputs = set(jg.fwd_outputs)
    reported = [n for n in jg.nodes if n in kept and n.op != "placeholder" and n not in outputs]
    base_reported = [n for n in baseline if n.op != "placeholder" and n not in outputs]
    return kept, set(recomputed), GraphPlan(
        policy=policy,
        kept=tuple(n.name for n in reported),
        recomputed=tuple(n.name for n in recomputed),
        kept_bytes=jg.bytes_of(reported),
        predicted_peak_bytes=sim.peak_bytes,
        baseline_peak_bytes=base_sim.peak_bytes,
        baseline_kept_bytes=jg.bytes_of(base_reported),
        recompute_flops=sum(node_flops(n) for n in recomputed),
        forward_flops=sum(node_flops(n) for n in jg.forward),
        num_nodes=len(jg.nodes),
        note=note,
    )
