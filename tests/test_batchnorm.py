"""BatchNorm twins: added before planning, free in forward, recomputed without the statistics."""

from __future__ import annotations

import operator

import torch

import memfit
from conftest import Split, conv_bn_net
from memfit.analysis.graph import JointGraph
from memfit.bench.graphs import joint_graphs
from memfit.capture.batchnorm import (
    FORWARD_TWIN,
    add_batchnorm_twins,
    drop_backward_statistics,
    is_training_batchnorm,
)

FUNCTIONAL = torch.ops.aten._native_batch_norm_legit_functional.default
NO_STATS = torch.ops.aten._native_batch_norm_legit.no_stats
BN_BACKWARD = torch.ops.aten.native_batch_norm_backward.default


def test_every_training_batchnorm_gets_a_twin_sharing_its_storage() -> None:
    (raw,) = joint_graphs(conv_bn_net(), torch.randn(2, 3, 8, 8), prepared=False)
    joint, num_fwd_outputs = raw.module, raw.num_fwd_outputs
    bns = [n for n in joint.graph.nodes if is_training_batchnorm(n)]
    assert len(bns) == 2
    assert add_batchnorm_twins(joint) == 2
    twins = [n for n in joint.graph.nodes if n.target is NO_STATS]
    assert [t.meta[FORWARD_TWIN] for t in twins] == [bn.name for bn in bns]
    for bn, twin in zip(bns, twins):
        # readers of output, mean and inverse std now read the twin; the original keeps only
        # the new running statistics
        assert {u.args[1] for u in bn.users if u.target is operator.getitem} == {3, 4}
        for a, b in zip(twin.meta["val"], bn.meta["val"][:3]):
            assert a is b  # the very fake tensors: one storage, one allocation in the model
    jg = JointGraph(joint, num_fwd_outputs)
    for bn, twin in zip(bns, twins):
        assert set(jg.storages[twin]) <= set(jg.storages[bn])
        assert twin in jg.forward and twin not in jg.forward_computed


def test_forward_runs_one_kernel_per_batchnorm_and_backward_recomputes_twins(
    split_graphs: list[Split],
) -> None:
    for policy in ("none", "collection"):  # keep everything / recompute everything
        model = conv_bn_net()
        wrapped = memfit.checkpoint(model, policy)
        wrapped(torch.randn(2, 3, 8, 8)).sum().backward()
    graphs = [(split.fw, split.bw) for split in split_graphs]
    (fw_none, bw_none), (fw_all, bw_all) = graphs
    for fw in (fw_none, fw_all):
        targets = [n.target for n in fw.graph.nodes]
        assert targets.count(FUNCTIONAL) == 2 and NO_STATS not in targets
    assert NO_STATS not in [n.target for n in bw_none.graph.nodes]
    assert [n.target for n in bw_all.graph.nodes].count(NO_STATS) == 2
    assert FUNCTIONAL not in [n.target for n in bw_all.graph.nodes]


def test_recomputed_batchnorm_updates_statistics_once_and_matches_eager() -> None:
    x = torch.randn(4, 3, 8, 8)
    eager = conv_bn_net()
    eager(x).sum().backward()
    model = conv_bn_net()
    wrapped = memfit.checkpoint(model, "collection")  # nothing marked: everything recomputed
    wrapped(x).sum().backward()
    recomputed = wrapped.memfit.plan.recomputed
    assert any("no_stats" in name or "batch_norm" in name for name in recomputed)
    for (name, a), (_, b) in zip(eager.named_buffers(), model.named_buffers()):
        assert torch.equal(a, b), name
    for (name, a), (_, b) in zip(eager.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)


def test_a_training_batchnorms_backward_is_handed_no_running_statistics() -> None:
    """It reads only the saved mean and inverse std; handed the new statistics, the backward
    made them saved values, held from the forward to each BatchNorm's backward."""
    (raw,) = joint_graphs(conv_bn_net(), torch.randn(2, 3, 8, 8), prepared=False)
    backwards = [n for n in raw.module.graph.nodes if n.target is BN_BACKWARD]
    assert len(backwards) == 2 and all(n.args[3] is not None for n in backwards)
    assert drop_backward_statistics(raw.module) == 2
    assert drop_backward_statistics(raw.module) == 0  # nothing left to drop
    (jg,) = joint_graphs(conv_bn_net(), torch.randn(2, 3, 8, 8))
    for node in jg.backward:
        if node.target is BN_BACKWARD:
            assert node.args[3] is None and node.args[4] is None and node.args[7] is True
    stats = [u for n in jg.forward if is_training_batchnorm(n) for u in n.users]
    assert len(stats) == 4 and not any(jg.is_backward(r) for s in stats for r in s.users)


class _Residual(torch.nn.Module):
    """ResNet's basic block: Conv-BN-ReLU, Conv-BN, the input added back, ReLU."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        nn = torch.nn
        self.a = nn.Sequential(
            nn.Conv2d(channels, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
        )
        self.b = nn.Sequential(
            nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.b(self.a(x)) + x)


def _residual_net() -> torch.nn.Module:
    nn = torch.nn
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        _Residual(16),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 4),
    )


def test_none_on_a_residual_conv_net_peaks_no_higher_than_eager() -> None:
    """``"none"`` keeps what eager autograd keeps: with the new running statistics saved for the
    backward it peaked 256 bytes (two 16-channel fp32 tensors, the stem's and the first block
    BatchNorm's) above plain PyTorch."""
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))

    def steps(model: torch.nn.Module) -> tuple[int, list[torch.Tensor]]:
        model(x).square().mean().backward()  # memfit: captured and planned outside the measure
        model.zero_grad(set_to_none=True)
        peak = memfit.measure(lambda: model(x).square().mean().backward()).peak_bytes
        assert peak is not None
        return peak, [p.grad for p in model.parameters()] + list(model.buffers())

    plain = _residual_net()
    plain_peak, plain_values = steps(plain)
    model = _residual_net()
    memfit.checkpoint(model, "none")
    peak, values = steps(model)
    assert all(torch.equal(a, b) for a, b in zip(values, plain_values, strict=True))
    assert peak <= plain_peak
