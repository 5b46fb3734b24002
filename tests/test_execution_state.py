"""``preserved``: buffers and random states (torch's, Python's, numpy's, the model's own
generators') are put back, also when the body raises."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn as nn

from memfit.execution.state import owned_generators, preserved


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


def test_pythons_numpys_and_the_models_own_random_states_are_put_back() -> None:
    """A forward drawing in its own Python (numpy, ``random``, a generator its module holds)
    leaves no trace either: the draws after the block are those there would be without it."""
    module = nn.Linear(2, 2)
    module.gen = torch.Generator().manual_seed(3)  # type: ignore[assignment]
    random.seed(0)
    np.random.seed(0)
    expected = (random.random(), np.random.rand(), torch.rand(1, generator=module.gen))
    random.seed(0)
    np.random.seed(0)
    module.gen.manual_seed(3)
    with preserved(module.buffers(), generators=owned_generators(module.modules())):
        random.random()
        np.random.choice(10, 3)
        torch.rand(4, generator=module.gen)
    assert (random.random(), np.random.rand()) == expected[:2]
    assert torch.equal(torch.rand(1, generator=module.gen), expected[2])


def test_owned_generators_are_found_once_each() -> None:
    shared = torch.Generator()
    outer = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    outer[0].gen = shared  # type: ignore[assignment]
    outer[1].gen = shared  # type: ignore[assignment]
    outer.other = torch.Generator()  # type: ignore[assignment]
    assert {id(g) for g in owned_generators(outer.modules())} == {id(shared), id(outer.other)}
    assert len(owned_generators(outer.modules())) == 2
