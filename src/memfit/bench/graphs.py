"""The joint graphs AOTAutograd builds for a model: inputs for the analysis and planning layers in
tests and in ``benchmarks/planning_time.py``.

memfit captures through its own backend (``memfit.execution.backend``), which plans as it goes;
tests of the analysis and planning layers, and the planner's timing benchmark, need the joint
graph alone. Recording it inside AOTAutograd's own default partition gives exactly the graph
``torch.compile`` would partition, without memfit's capture in the way; by default the rewrites
memfit applies before planning (``capture.passes``) are applied too, so the graph is the one
memfit's planner sees.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memfit._compat import aot_autograd, default_partition, make_boxed_func
from memfit.analysis.graph import JointGraph
from memfit.capture.passes import prepare_joint_graph
from memfit.execution.executors import EAGER, INDUCTOR, decompositions

__all__ = ["joint_graphs"]


def joint_graphs(
    model: nn.Module,
    *args: Any,
    prepared: bool = True,
    dynamic: bool = False,
    executor: str = EAGER,
) -> list[JointGraph]:
    """The joint graphs AOTAutograd builds for ``model(*args)`` (one per graph-break piece).

    ``prepared``: apply memfit's pre-planning rewrites (marks, BatchNorm twins) first.
    ``dynamic``: capture every input size as a symbol (``torch.compile(dynamic=True)``; sizes 0
    and 1 stay constants), as Dynamo captures a size that varied between calls. Resets Dynamo
    first (``torch.compiler.reset()``), so earlier compilations cannot stand in.
    ``executor``: the graph as memfit plans it for that executor (``"inductor"``: decomposed as
    Inductor compiles it, ``JointGraph.fused_elementwise`` set).
    """
    graphs: list[JointGraph] = []

    def record(joint: torch.fx.GraphModule, inputs: Any, **kwargs: Any) -> Any:
        if prepared:
            prepare_joint_graph(joint, inductor=executor == INDUCTOR)
        jg = JointGraph(joint, kwargs["num_fwd_outputs"])
        jg.fused_elementwise = executor == INDUCTOR
        jg.static_inputs = frozenset(kwargs.get("static_lifetime_input_indices") or ())
        graphs.append(jg)
        return default_partition(joint, inputs, **kwargs)

    torch.compiler.reset()
    backend = aot_autograd(
        fw_compiler=lambda g, _: make_boxed_func(g.forward),
        partition_fn=record,
        decompositions=decompositions(executor),
    )
    torch.compile(model, backend=backend, dynamic=dynamic)(*args)
    return graphs
