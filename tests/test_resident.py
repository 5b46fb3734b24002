"""memfit.measurement.resident: the bytes live before a step, each storage counted once."""

from __future__ import annotations

import torch
from torch import nn

from memfit.measurement.resident import input_bytes, resident_bytes


def test_input_bytes_count_each_storage_once() -> None:
    x = torch.randn(4, 8)
    assert input_bytes((x, x[:2]), {"y": torch.zeros(3, dtype=torch.int64)}) == 4 * 8 * 4 + 24


def test_a_meta_input_counts_the_bytes_it_stands_for_unless_asked_not_to() -> None:
    meta = torch.empty(5, 2, device="meta", dtype=torch.bfloat16)
    assert input_bytes((meta,), {}) == 20
    assert input_bytes((meta,), {"labels": meta}) == 20  # one tensor passed twice
    assert input_bytes((meta,), {}, meta=False) == 0


def test_resident_bytes_count_tied_weights_once_and_an_input_that_is_a_weight_not_at_all() -> None:
    model = nn.Linear(4, 4, bias=False)
    model.register_buffer("tied", model.weight.data)
    x = torch.randn(3, 4)
    assert resident_bytes(model, (x, model.weight), {"x2": x[1:]}) == (64, 48)
    with torch.device("meta"):
        meta = nn.Linear(4, 4)
    assert resident_bytes(meta, (torch.empty(2, 4, device="meta"),)) == (0, 0)
