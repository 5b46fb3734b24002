"""``preserved``: buffers and random states are put back, also when the body raises."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from memfit.execution.state import preserved


def test_batchnorm_statistics_and_random_stream_are_put_back() -> None:
    bn = nn.BatchNorm1d(4).train()
    before = [b.clone() for b in bn.buffers()]
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match="inside"):
        with preserved(bn.buffers()):
            bn(torch.randn(8, 4))
            torch.rand(5)
            raise RuntimeError("inside")
    assert all(torch.equal(a, b) for a, b in zip(before, bn.buffers()))
    assert torch.equal(torch.rand(3), expected)
