"""Scratch memory is measured on real tensors, without touching the user's RNG stream."""

import torch
import torch.nn as nn

from graphs import joint_graphs
from memfit.analysis.workspace import measure_workspace


def test_convolution_scratch_is_measured_and_rng_untouched() -> None:
    model = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.Dropout(0.5))
    (jg,) = joint_graphs(model, torch.randn(4, 8, 32, 32))
    state = torch.get_rng_state()
    scratch = measure_workspace(jg.nodes)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(v > 0 for v in scratch.values())
    assert not any(n.target is torch.ops.aten.native_dropout.default for n in scratch)
    conv_bwd = [n for n in jg.backward if n.target is torch.ops.aten.convolution_backward.default]
    assert conv_bwd and all(n in scratch for n in conv_bwd)  # oneDNN keeps buffers on CPU
