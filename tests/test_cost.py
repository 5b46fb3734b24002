"""FLOPs per node agree with torch's FlopCounterMode formulas; heavy ops are recognised."""

import torch
import torch.nn as nn

from memfit.analysis.cost import is_compute_heavy, node_flops
from memfit.bench.graphs import joint_graphs


def test_matmul_flops_and_heaviness() -> None:
    (jg,) = joint_graphs(nn.Sequential(nn.Linear(32, 64), nn.ReLU()), torch.randn(8, 32))
    addmm = next(n for n in jg.forward if n.target is torch.ops.aten.addmm.default)
    relu = next(n for n in jg.forward if n.target is torch.ops.aten.relu.default)
    assert node_flops(addmm) == 2 * 8 * 32 * 64
    assert is_compute_heavy(addmm) and not is_compute_heavy(relu)
    assert node_flops(relu) == 8 * 64  # one per output element
