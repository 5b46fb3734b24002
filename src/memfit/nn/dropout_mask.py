"""Dropout keep-masks for attention probabilities, drawn exactly as eager ``F.dropout`` draws them.

When memfit replaces a model's naive attention by ``chunked_attention``, the probabilities
tensor that ``F.dropout`` used to drop no longer exists, but the model must still get the same
dropout decisions and the same random stream afterwards, or a memfit run and a plain run of one
seed would diverge. ``attention_dropout_mask(shape, p, device)`` returns the keep-mask eager
``F.dropout(x, p, training=True)`` would draw for an ``x`` of that shape under the current
generator state, packed eight to a byte (``memfit.nn.bits``), and leaves the generator where
eager leaves it. It is a ``torch.library`` custom op tagged ``nondeterministic_seeded``, so
memfit's planner never recomputes it: the mask is drawn once and kept (a thirty-second of the
fp32 probabilities) for backward.

NOTE [How eager draws dropout on CPU, torch 2.13]
    Eager CPU ``F.dropout`` runs ``_dropout_impl``: ``noise = empty_like(x).bernoulli_(1 - p)``
    (x's dtype), ``x * noise / (1 - p)``; a traced graph runs ``aten.native_dropout``, which
    draws a bool tensor with the same ``bernoulli_(1 - p)``. Both reach ATen's scalar
    ``bernoulli_`` kernel (``aten/src/ATen/native/cpu/DistributionKernels.cpp``). Its default
    path (``DistributionTemplates.h``) is a serial loop in the tensor's element order that
    draws one ``bernoulli_distribution<double>`` sample (a 64-bit uniform) per element from the
    CPU generator, whatever the dtype. So drawing the flat sequence chunk by chunk gives the
    same bits and the same final generator state as one draw; that is what this module does
    (transient memory: one chunk). torch builds with MKL have had another path, chosen by the
    CPU's vendor in some releases (Intel) or always in others: one seed taken from the
    generator, or a separate MKL generator, and a VSL stream split across threads; there a
    chunked draw differs from a whole one. On this machine (AMD EPYC, torch 2.13.0+cpu with MKL)
    the serial path runs: chunked, whole, bool and float draws all agree bit for bit and leave
    equal generator states. Rather than trust the vendor, the first CPU draw of a process runs
    a small self-check on a private generator (whole vs chunked, bool vs the probabilities'
    dtype, the generator it was given actually advanced and the global one untouched); if it
    fails, masks are drawn whole, exactly as eager does (noise in the probabilities' dtype, then
    packed), which costs transient memory of one noise tensor but is exact by construction.
    p == 0 (and an empty shape) draws nothing, as eager's ``dropout`` returns its input then.

NOTE [CUDA, not tested here]
    Eager CUDA ``F.dropout`` calls the fused ``native_dropout`` kernel (Philox; a thread's
    elements and the offset advance depend on numel, grid size, the dtype's vector width and
    the input's alignment). To reproduce it the mask is drawn by calling ``native_dropout``
    itself on a fresh contiguous tensor of the probabilities' shape and dtype (hence the
    ``dtype`` argument) and packing its bool mask: transient memory of that tensor, its output
    and the bool mask. The machine this was written on has no GPU; the CPU tests do not
    exercise this path.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from memfit.nn.bits import pack_bits, packed_width

__all__ = ["attention_dropout_mask"]

#: Mask elements drawn (and packed) per chunk on CPU: 1 MiB of bool plus about 2 MiB while packing.
_CHUNK_ELEMENTS = 1 << 20


def attention_dropout_mask(
    shape: Sequence[int],
    p: float,
    device: torch.device | str = "cpu",
    *,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """The keep-mask eager ``F.dropout(x, p, training=True)`` draws for ``x`` of ``shape``, packed.

    Args:
        shape: the probabilities' shape ``[*B, Lq, Lk]`` (at least one dim).
        p: dropout probability, in [0, 1).
        device: where ``x`` lives; the mask is drawn from that device's default generator.
        dtype: ``x``'s dtype. On CPU the bits do not depend on it (checked once per process);
            on CUDA eager's fused kernel lays out its random numbers by it.

    Returns:
        uint8 ``[*shape[:-1], ceil(shape[-1] / 8)]``: bit ``j % 8`` of byte ``j // 8`` is 1 where
        eager keeps element ``j`` (``memfit.nn.bits.unpack_bits`` gives the bool mask). The
        default generator is left in the state eager's draw leaves it in.

    Raises:
        ValueError: ``p`` is outside [0, 1), or ``shape`` is empty or has negative sizes.
    """
    if not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability p must be in [0, 1), got {p!r}")
    # A size traced with dynamic shapes stays a SymInt: int() would specialize the graph to it.
    dims = [d if isinstance(d, torch.SymInt) else int(d) for d in shape]
    if not dims or any(d < 0 for d in dims):
        raise ValueError(f"shape must have at least one dim and no negative sizes, got {shape!r}")
    result: Tensor = torch.ops.memfit.attention_dropout_mask(
        dims, float(p), torch.device(device), dtype
    )
    return result


@torch.library.custom_op(
    "memfit::attention_dropout_mask",
    mutates_args=(),
    tags=(torch.Tag.nondeterministic_seeded,),
)
def _mask_op(shape: Sequence[int], p: float, device: torch.device, dtype: torch.dtype) -> Tensor:
    rows, n = math.prod(shape[:-1]), shape[-1]
    out = torch.empty((rows, packed_width(n)), dtype=torch.uint8, device=device)
    if p == 0.0 or rows * n == 0:
        _fill_all_kept(out, n)
    elif device.type == "cuda":
        x = torch.empty(list(shape), dtype=dtype, device=device)
        _pack_rows(out, torch.ops.aten.native_dropout(x, p, True)[1].view(rows, n))
    elif device.type == "cpu" and _cpu_mode(dtype) == "chunks":
        step = max(1, _CHUNK_ELEMENTS // max(n, 1))
        for start in range(0, rows, step):
            stop = min(start + step, rows)
            keep = torch.empty((stop - start, n), dtype=torch.bool).bernoulli_(1.0 - p)
            out[start:stop] = pack_bits(keep)
    else:
        noise = torch.empty((rows, n), dtype=dtype, device=device).bernoulli_(1.0 - p)
        _pack_rows(out, noise != 0)
    return out.view(*shape[:-1], packed_width(n))


@_mask_op.register_fake
def _mask_fake(shape: Sequence[int], p: float, device: torch.device, dtype: torch.dtype) -> Tensor:
    return torch.empty((*shape[:-1], packed_width(shape[-1])), dtype=torch.uint8, device=device)


def _pack_rows(out: Tensor, keep: Tensor) -> None:
    """Pack a bool ``[rows, n]`` into ``out`` a chunk of rows at a time (packing's own
    temporaries stay one chunk)."""
    step = max(1, _CHUNK_ELEMENTS // max(keep.shape[-1], 1))
    for start in range(0, keep.shape[0], step):
        out[start : start + step] = pack_bits(keep[start : start + step])


def _fill_all_kept(out: Tensor, n: int) -> None:
    out.fill_(0xFF)
    if n % 8 and out.shape[-1]:
        out[:, -1] = (1 << (n % 8)) - 1  # padding bits stay zero, as pack_bits leaves them


@functools.cache
def _cpu_mode(dtype: torch.dtype) -> str:
    """``"chunks"`` if CPU ``bernoulli_`` draws serially per element from the generator it is
    given, identically for bool and ``dtype``; else ``"whole"``. See the NOTE at the top."""
    sizes = (1000, 3, 2048, 1049)  # straddles the MKL path's 800-element parallel grain
    seed = 20261122
    before = torch.get_rng_state()
    g = torch.Generator().manual_seed(seed)
    fresh = g.get_state()
    whole = torch.empty(sum(sizes), dtype=torch.bool).bernoulli_(0.75, generator=g)
    after_whole = g.get_state()
    g.manual_seed(seed)
    parts = torch.cat(
        [torch.empty(s, dtype=torch.bool).bernoulli_(0.75, generator=g) for s in sizes]
    )
    after_parts = g.get_state()
    g.manual_seed(seed)
    noise = torch.empty(sum(sizes), dtype=dtype).bernoulli_(0.75, generator=g)
    serial = (
        torch.equal(whole, parts)
        and torch.equal(whole, noise != 0)
        and torch.equal(after_whole, after_parts)
        and torch.equal(after_whole, g.get_state())
        and not torch.equal(fresh, after_whole)
        and torch.equal(before, torch.get_rng_state())
    )
    return "chunks" if serial else "whole"
