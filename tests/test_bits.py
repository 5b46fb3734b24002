"""Bit packing round-trips exactly, chunk by chunk, at a thirty-second of fp32's bytes."""

from __future__ import annotations

import pytest
import torch

from memfit.nn.bits import pack_bits, packed_width, unpack_bits


@pytest.mark.parametrize("n", [1, 7, 8, 9, 64, 77])
def test_round_trip(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    mask = torch.rand(3, 5, n, generator=g) < 0.4
    packed = pack_bits(mask)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, packed_width(n))
    assert torch.equal(unpack_bits(packed, n), mask)


def test_chunks_of_columns_unpack_alone() -> None:
    mask = torch.rand(2, 4, 100, generator=torch.Generator().manual_seed(0)) < 0.5
    packed = pack_bits(mask)
    for start in range(0, 100, 13):
        width = min(13, 100 - start)
        assert torch.equal(unpack_bits(packed, width, start), mask[..., start : start + width])


def test_bytes_are_a_thirty_second_of_fp32() -> None:
    packed = pack_bits(torch.ones(4, 256, dtype=torch.bool))
    assert packed.numel() * packed.element_size() * 32 == 4 * 256 * 4


def test_bad_input_is_refused() -> None:
    with pytest.raises(TypeError, match="bool"):
        pack_bits(torch.ones(3))
    with pytest.raises(TypeError, match="uint8"):
        unpack_bits(torch.ones(3), 3)
    with pytest.raises(ValueError, match="outside"):
        unpack_bits(pack_bits(torch.ones(9, dtype=torch.bool)), 10, 8)
