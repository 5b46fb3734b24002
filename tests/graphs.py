"""Capture joint graphs for unit tests of the analysis and planning layers."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import default_partition

from memfit.analysis.graph import JointGraph


def joint_graphs(model: nn.Module, *args: Any) -> list[JointGraph]:
    """The joint graphs AOTAutograd builds for ``model(*args)`` (one per graph-break piece)."""
    graphs: list[JointGraph] = []

    def record(joint: torch.fx.GraphModule, inputs: Any, **kwargs: Any) -> Any:
        graphs.append(JointGraph(joint, kwargs["num_fwd_outputs"]))
        return default_partition(joint, inputs, **kwargs)

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward),
                           partition_fn=record)
    torch.compile(model, backend=backend, dynamic=False)(*args)
    return graphs
