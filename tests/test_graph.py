"""JointGraph: forward/backward by dataflow, bytes per storage, what backward needs."""

import torch
import torch.nn as nn

from memfit.bench.graphs import joint_graphs


def test_forward_backward_split_and_storage_bytes() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    (jg,) = joint_graphs(model, torch.randn(8, 16))
    names = {n.name: n for n in jg.nodes}
    assert names["tanh"] in jg.forward
    assert all(not jg.is_backward(n) for n in jg.forward)
    assert any(n.target is torch.ops.aten.tanh_backward.default for n in jg.backward)
    own = jg.own_bytes()
    assert own[names["tanh"]] == 8 * 32 * 4
    # views of a parameter (t) allocate nothing, and primals are never counted
    assert own[names["t"]] == 0
    assert jg.bytes_of(jg.primals) == 0


def test_saved_needed_includes_primals_and_random_values() -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5), nn.Linear(16, 4))
    (jg,) = joint_graphs(model, torch.randn(8, 16))
    needed = jg.saved_needed([])  # keep nothing: recompute all that may be recomputed
    assert any(n.op == "placeholder" for n in needed)  # inputs/weights reach the backward
    random_items = [n for n in needed if jg.never_recompute(n)]
    assert random_items, "the dropout mask must be kept whatever the policy says"
