"""memfit.Device: the built-in descriptions, their lookup, and the CUDA caching allocator's
rounding as a pure function (literal cases from c10/cuda/CUDACachingAllocator.cpp's rules)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import memfit
from conftest import CUDA
from memfit.analysis.devices import (
    DEVICES,
    CudaAllocator,
    allocated_bytes,
    get_device,
    known_devices,
    reserved_bytes,
)

MIB = 2**20


def test_lookup_is_case_insensitive_and_takes_aliases() -> None:
    assert memfit.Device.named("H100-80GB") is DEVICES["h100-80gb"]
    assert get_device("  h100 ") is DEVICES["h100-80gb"]
    assert get_device("RTX_4090") is DEVICES["rtx-4090"]
    device = DEVICES["l4"]
    assert get_device(device) is device


def test_an_unknown_device_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown device 'h900'") as err:
        get_device("h900")
    for name in ("a100-40gb", "a100-80gb", "h100-80gb", "h200", "l4", "rtx-4090"):
        assert name in str(err.value)
    assert known_devices() == sorted(DEVICES)


def test_the_built_in_figures() -> None:
    h100 = get_device("h100-80gb")
    assert h100.type == "cuda"
    assert h100.capacity_bytes == 81_559 * MIB
    assert h100.flops_for(torch.bfloat16) == 989e12
    assert h100.flops_for("float16") == 989e12
    assert h100.memory_bandwidth == 3.35e12
    assert get_device("h200").memory_bandwidth == 4.8e12
    assert get_device("a100-40gb").memory_bandwidth == 1.555e12
    assert get_device("a100-80gb").memory_bandwidth == 2.039e12
    assert get_device("l4").flops_for("bfloat16") == 121e12
    assert get_device("rtx-4090").flops_for("bfloat16") == 165.2e12
    for device in DEVICES.values():
        assert set(device.flops) == {"float32", "tf32", "bfloat16", "float16"}
        assert 0 < device.usable_bytes < device.capacity_bytes
        assert device.host_bandwidth in (25e9, 50e9)
    with pytest.raises(ValueError, match="no FLOP/s figure for float64"):
        h100.flops_for(torch.float64)


def test_a_device_can_be_described_as_part_of_one() -> None:
    half = dataclasses.replace(get_device("l4"), capacity_bytes=12 * 2**30)
    assert half.usable_bytes == 12 * 2**30 - half.context_bytes
    with pytest.raises(dataclasses.FrozenInstanceError):
        half.capacity_bytes = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("nbytes", "allocated", "reserved"),
    [
        (0, 0, 2 * MIB),
        (1, 512, 2 * MIB),
        (512, 512, 2 * MIB),
        (513, 1024, 2 * MIB),
        (MIB, MIB, 2 * MIB),  # the largest small request
        (MIB + 1, MIB + 512, 20 * MIB),  # a large one from a 20 MiB segment, split off
        (9 * MIB + MIB // 2, 9 * MIB + MIB // 2, 20 * MIB),
        (10 * MIB, 10 * MIB, 10 * MIB),  # a segment of its own, rounded to 2 MiB
        (10 * MIB + 1, 10 * MIB + 512, 12 * MIB),  # 2 MiB - 512 remain: split
        (11 * MIB + 1, 12 * MIB, 12 * MIB),  # under 1 MiB would remain: the whole segment
        (19 * MIB + 1, 20 * MIB, 20 * MIB),
    ],
)
def test_the_allocator_rounds_as_torch_does(nbytes: int, allocated: int, reserved: int) -> None:
    assert allocated_bytes(nbytes) == allocated
    assert reserved_bytes(nbytes) == reserved
    assert get_device("h100-80gb").allocated_bytes(nbytes) == allocated


def test_allocated_never_below_the_request_nor_above_the_segment() -> None:
    alloc = CudaAllocator()
    for nbytes in [*range(0, 4096, 97), *range(MIB - 4096, 30 * MIB, 123_457)]:
        a = alloc.allocated_bytes(nbytes)
        assert nbytes <= a <= max(alloc.reserved_bytes(nbytes), a)
        assert a % 512 == 0
        assert a - nbytes < 512 or a == alloc.reserved_bytes(nbytes)
    with pytest.raises(ValueError, match="cannot be negative"):
        alloc.allocated_bytes(-1)


@CUDA
@pytest.mark.parametrize("nbytes", [1, 513, MIB, MIB + 1, 9 * MIB, 10 * MIB + 1, 11 * MIB + 1])
def test_the_rounding_is_what_cuda_counts(nbytes: int) -> None:
    """On a GPU: a tensor allocated on an emptied cache adds ``allocated_bytes`` to
    ``memory_allocated`` (nothing else of this test alive)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    assert torch.cuda.memory_allocated() - before == allocated_bytes(nbytes)
    del x
