"""Boolean tensors packed eight to a byte along their last dimension.

A dropout mask over attention probabilities has one entry per (query, key) pair: stored as
bool it is a quarter of the fp32 probabilities, packed as bits a thirty-second. Kernels keep the
packed mask for backward and unpack one chunk of keys at a time, so the full boolean mask never
exists at once. Bit ``j % 8`` of byte ``j // 8`` holds column ``j`` (least significant bit first);
the padding bits of the last byte are zero.
"""

from __future__ import annotations

import torch

__all__ = ["pack_bits", "unpack_bits", "packed_width"]

_WEIGHTS = [1 << i for i in range(8)]


def packed_width(columns: int) -> int:
    """Bytes needed for ``columns`` bits."""
    return (columns + 7) // 8


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Pack a bool tensor ``[..., n]`` into uint8 ``[..., ceil(n / 8)]``."""
    if mask.dtype != torch.bool:
        raise TypeError(f"pack_bits takes a bool tensor, got {mask.dtype}")
    n = mask.shape[-1]
    pad = packed_width(n) * 8 - n
    if pad:
        mask = torch.nn.functional.pad(mask, (0, pad))
    groups = mask.reshape(*mask.shape[:-1], -1, 8).to(torch.uint8)
    weights = torch.tensor(_WEIGHTS, dtype=torch.uint8, device=mask.device)
    return (groups * weights).sum(-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, columns: int, start: int = 0) -> torch.Tensor:
    """Columns ``start : start + columns`` of the bool tensor ``packed`` holds, as bool.

    Only the bytes covering those columns are expanded, so unpacking one chunk of keys costs
    memory for that chunk alone.
    """
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_bits takes a uint8 tensor, got {packed.dtype}")
    if start < 0 or columns < 0 or start + columns > packed.shape[-1] * 8:
        raise ValueError(
            f"columns {start}:{start + columns} lie outside the {packed.shape[-1] * 8} bits packed"
        )
    first, last = start // 8, packed_width(start + columns)
    weights = torch.tensor(_WEIGHTS, dtype=torch.uint8, device=packed.device)
    bits = (packed[..., first:last, None] & weights) != 0
    bits = bits.reshape(*packed.shape[:-1], -1)
    offset = start - first * 8
    return bits[..., offset : offset + columns]
