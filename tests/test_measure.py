"""Tests for memfit.measurement.measure: the public ``measure`` and ``Measurement``.

How the bytes are counted is tested per device in test_measurement_cpu.py and
test_measurement_cuda.py; here: results, errors, device resolution and the reachable-tensor walk.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import pytest
import torch

from measuring import FLOATS_PER_MB, MB
from memfit.measurement import Measurement, measure


def test_cpu_profile_memory_false_measures_time_only():
    m = measure(lambda: torch.empty(FLOATS_PER_MB), profile_memory=False)
    assert m.peak_bytes is None and m.end_bytes is None
    assert m.timeline == []
    assert m.time_s >= 0
    assert "memory not measured" in str(m)


def test_time_is_wall_time():
    m = measure(time.sleep, 0.05)
    assert 0.05 <= m.time_s < 1.0


def test_fn_runs_exactly_once_with_args_and_kwargs():
    calls = []

    def fn(a, b, *, c):
        calls.append((a, b, c))
        return a + b + c

    m = measure(fn, 1, 2, c=3)
    assert calls == [(1, 2, 3)]
    assert m.result == 6


def test_fn_may_take_a_keyword_named_fn():
    m = measure(lambda fn: fn * 2, fn=21)
    assert m.result == 42


def test_measurement_is_frozen_and_readable():
    m = measure(lambda: torch.empty(FLOATS_PER_MB))
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.peak_bytes = 0  # type: ignore[misc]
    text = str(m)
    assert text.startswith("peak 976.56 KiB, end +976.56 KiB, ")
    assert text.endswith(" on cpu")
    assert "result" not in repr(m)  # the result may be a huge tensor
    assert isinstance(m, Measurement)


def test_str_of_negative_end():
    m = Measurement(
        peak_bytes=0, end_bytes=-3 * 1024 * 1024, time_s=0.041, device="cpu", result=None
    )
    assert str(m) == "peak 0 B, end -3.00 MiB, 41 ms on cpu"


# --------------------------------------------------------------------------- validation


def test_not_callable_raises_type_error():
    with pytest.raises(TypeError, match="callable.*int"):
        measure(3)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "", "meta", "cpu:1"])
def test_bad_device_string_raises_value_error(bad):
    with pytest.raises(ValueError) as info:
        measure(lambda: None, device=bad)
    message = str(info.value)
    assert repr(bad) in message


def test_bad_device_message_lists_accepted_forms():
    with pytest.raises(ValueError, match='"cpu", "cuda", "cuda:N"'):
        measure(lambda: None, device="gpu")


def test_bad_device_type_raises_type_error():
    with pytest.raises(TypeError, match="int"):
        measure(lambda: None, device=0)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
@pytest.mark.parametrize("dev", ["cuda", "cuda:0", torch.device("cuda")])
def test_cuda_without_cuda_raises_value_error(dev):
    with pytest.raises(ValueError, match="CUDA is not available"):
        measure(lambda: None, device=dev)


def test_explicit_cpu_device_forms():
    assert measure(lambda: None, device="cpu").device == "cpu"
    assert measure(lambda: None, device=torch.device("cpu")).device == "cpu"


def test_device_inferred_cpu_for_cpu_tensors():
    x = torch.ones(3)
    assert measure(torch.sum, x).device == "cpu"
    assert measure(lambda: None).device == "cpu"


def test_reachable_through_optimizer_partial_and_objects():
    model = torch.nn.Linear(500, 500, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 500)).sum().backward()
    opt.step()  # creates a 1 MB momentum buffer in opt.state

    class Trainer:
        def __init__(self, optimizer):
            self.optimizer = optimizer

        def drop_state(self):
            self.optimizer.state.clear()

    m = measure(Trainer(opt).drop_state)
    assert m.end_bytes == -MB

    def drop_grads(module):
        module.zero_grad(set_to_none=True)

    m = measure(functools.partial(drop_grads, model))
    assert m.end_bytes == -MB


def test_reachable_through_a_modules_plain_tensor_attributes():
    """A module that keeps a tensor as a plain attribute (a cache, a random state) and replaces
    it: the old one's free is seen, so the call ends where it started."""

    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.nn.Module()
            self.inner.cache = torch.zeros(FLOATS_PER_MB)

        def forward(self) -> None:
            self.inner.cache = torch.ones(FLOATS_PER_MB)

    m = measure(Holder())
    assert m.end_bytes == 0 and m.peak_bytes == MB
