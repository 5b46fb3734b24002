"""Descriptions of accelerators memfit can plan for without having one.

Why: "will this fit on an H100?" is asked before renting one. A ``Device`` holds the figures a plan
needs to answer it: how much memory the allocator may hand out (``capacity_bytes``, less
``context_bytes``), how fast it computes per dtype and moves bytes (HBM, host link), and how
torch's CUDA caching allocator rounds each tensor (``CudaAllocator``). Each built-in figure names
its source: vendor datasheets for speeds (dense, without sparsity), NVML's ``memory.total`` (what
``nvidia-smi`` and ``torch.cuda.mem_get_info`` report, in MiB) for capacities.

Which counter a prediction is for: ``CudaAllocator.allocated_bytes`` is what
``torch.cuda.max_memory_allocated`` counts for one tensor (its block); ``reserved_bytes`` the
segment the allocator would take from the driver for it on an empty cache
(``max_memory_reserved``). memfit's predictions are of the allocated counter; what the process
needs from the device is that plus the CUDA context (``context_bytes``) plus the cache's slack
(reserved minus allocated), which depends on the order of allocations and is not predicted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

__all__ = [
    "CudaAllocator",
    "Device",
    "DEVICES",
    "allocated_bytes",
    "reserved_bytes",
    "get_device",
    "known_devices",
]

_MIB = 2**20
_TERA = 1e12
_GIGA = 1e9


@dataclass(frozen=True)
class CudaAllocator:
    """The rounding rules of torch's CUDA caching allocator with its default settings.

    From ``c10/cuda/CUDACachingAllocator.cpp`` (``round_size``, ``get_allocation_size``,
    ``should_split``), ``PYTORCH_CUDA_ALLOC_CONF`` unset: a request is rounded up to a multiple of
    512 B (``min_block``); requests up to 1 MiB (``small_size``) come from 2 MiB segments
    (``small_segment``), larger ones below 10 MiB (``min_large_alloc``) from 20 MiB segments
    (``large_segment``), and from 10 MiB up each gets its own segment rounded to 2 MiB
    (``round_large``). A block carved from a large segment is split only if more than 1 MiB
    would remain; otherwise the whole segment is the block, and ``max_memory_allocated``
    counts all of it. ``expandable_segments`` and ``roundup_power2_divisions`` change these
    rules and are not modelled.
    """

    #: every block is a multiple of this many bytes, and at least this many
    min_block: int = 512
    #: requests up to this size are served from the small pool
    small_size: int = 1 * _MIB
    #: the segment size of the small pool
    small_segment: int = 2 * _MIB
    #: the segment size for large requests below ``min_large_alloc``
    large_segment: int = 20 * _MIB
    #: from this size on a request gets a segment of its own
    min_large_alloc: int = 10 * _MIB
    #: a segment of its own is rounded up to a multiple of this
    round_large: int = 2 * _MIB

    def block_bytes(self, nbytes: int) -> int:
        """``nbytes`` rounded as the allocator rounds a request (``round_size``)."""
        if nbytes < 0:
            raise ValueError(f"a tensor's size in bytes cannot be negative, got {nbytes}")
        return max(self.min_block, self.min_block * math.ceil(nbytes / self.min_block))

    def reserved_bytes(self, nbytes: int) -> int:
        """The segment a request of ``nbytes`` gets on an empty cache (``get_allocation_size``):
        what ``memory_reserved`` grows by."""
        size = self.block_bytes(nbytes)
        if size <= self.small_size:
            return self.small_segment
        if size < self.min_large_alloc:
            return self.large_segment
        return self.round_large * math.ceil(size / self.round_large)

    def allocated_bytes(self, nbytes: int) -> int:
        """What ``memory_allocated`` counts for a tensor of ``nbytes`` given a fresh segment:
        its rounded block, or the whole segment where the rest (1 MiB or less) is not split off.
        0 bytes (an empty tensor) allocates nothing."""
        if nbytes == 0:
            return 0
        size = self.block_bytes(nbytes)
        if size <= self.small_size:
            return size  # the small pool splits down to 512 B
        segment = self.reserved_bytes(nbytes)
        return size if segment - size > self.small_size else segment


_DEFAULT_ALLOCATOR = CudaAllocator()


def allocated_bytes(nbytes: int) -> int:
    """``CudaAllocator().allocated_bytes``: the ``max_memory_allocated`` size of one tensor."""
    return _DEFAULT_ALLOCATOR.allocated_bytes(nbytes)


def reserved_bytes(nbytes: int) -> int:
    """``CudaAllocator().reserved_bytes``: the segment one tensor takes on an empty cache."""
    return _DEFAULT_ALLOCATOR.reserved_bytes(nbytes)


#: Memory the CUDA context takes outside the caching allocator (driver state, kernels loaded
#: lazily, cuBLAS handles): 300-500 MB with lazy module loading (CUDA 11.7 on; pytorch#107667,
#: #20532); 512 MiB is counted, the high end of those reports.
CUDA_CONTEXT_BYTES = 512 * _MIB


@dataclass(frozen=True)
class Device:
    """One accelerator as a planner sees it: memory, speed and the allocator's rules.

    ``memfit.Device.named("h100-80gb")`` gives a built-in one (``known_devices()`` lists them);
    ``dataclasses.replace(device, capacity_bytes=...)`` describes a part of one (what other
    processes leave). All speeds are peaks: dense tensor-core FLOP/s from the datasheet, which
    no training step reaches, so times made from them are lower bounds.
    """

    #: the name it is looked up by, lower case (``"h100-80gb"``)
    name: str
    #: what the vendor calls it
    title: str
    #: torch's device type: what a plan for it is made on (``"cuda"``)
    type: str
    #: memory the device reports (NVML ``memory.total``), in bytes
    capacity_bytes: int
    #: peak FLOP/s per compute dtype: ``"float32"`` (CUDA cores), ``"tf32"`` (fp32 matmuls with
    #: ``torch.backends.cuda.matmul.allow_tf32``), ``"bfloat16"``, ``"float16"`` (tensor cores,
    #: fp32 accumulation, dense)
    flops: dict[str, float] = field(default_factory=dict)
    #: device memory bandwidth, bytes/s
    memory_bandwidth: float = 0.0
    #: host link bandwidth one way, bytes/s, achievable (not the link's nominal rate)
    host_bandwidth: float = 0.0
    #: device memory outside the caching allocator (CUDA context): not available to tensors
    context_bytes: int = CUDA_CONTEXT_BYTES
    #: how the allocator rounds each tensor
    allocator: CudaAllocator = _DEFAULT_ALLOCATOR

    @classmethod
    def named(cls, name: str) -> Device:
        """The built-in description called ``name`` (case-insensitive); see ``get_device``."""
        return get_device(name)

    @property
    def usable_bytes(self) -> int:
        """What the caching allocator can hand to tensors: capacity less the context."""
        return self.capacity_bytes - self.context_bytes

    def flops_for(self, dtype: torch.dtype | str) -> float:
        """Peak FLOP/s for matmuls computed in ``dtype`` (``torch.bfloat16`` or its name)."""
        key = str(dtype).removeprefix("torch.")
        if key not in self.flops:
            raise ValueError(
                f"{self.name} has no FLOP/s figure for {key}; it has "
                f"{', '.join(sorted(self.flops))}"
            )
        return self.flops[key]

    def allocated_bytes(self, nbytes: int) -> int:
        """What ``max_memory_allocated`` counts for one tensor of ``nbytes`` on this device."""
        return self.allocator.allocated_bytes(nbytes)


# PCIe achievable one-way rates (pinned host memory, large copies): ~25 GB/s for Gen4 x16
# (32 GB/s nominal), ~50 GB/s for Gen5 x16 (64 GB/s nominal).
_PCIE4 = 25 * _GIGA
_PCIE5 = 50 * _GIGA


def _flops(fp32: float, tf32: float, bf16: float, fp16: float) -> dict[str, float]:
    return {"float32": fp32, "tf32": tf32, "bfloat16": bf16, "float16": fp16}


#: The built-in devices by name. Capacities: NVML's memory.total in MiB (as nvidia-smi reports it,
#: collected at https://thundergolfer.com/blog/nvidia-gpu-memory-capacity; RTX 4090 as nvidia-smi
#: shows it, 24564 MiB).
DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        # A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4): 19.5 TF fp32, 156 TF tf32,
        # 312 TF bf16/fp16 dense; 1,555 GB/s (40GB HBM2), 2,039 GB/s (80GB HBM2e SXM); PCIe Gen4.
        Device(
            "a100-40gb",
            "NVIDIA A100-SXM4-40GB",
            "cuda",
            40_960 * _MIB,
            _flops(19.5 * _TERA, 156 * _TERA, 312 * _TERA, 312 * _TERA),
            1_555 * _GIGA,
            _PCIE4,
        ),
        Device(
            "a100-80gb",
            "NVIDIA A100-SXM4-80GB",
            "cuda",
            81_920 * _MIB,
            _flops(19.5 * _TERA, 156 * _TERA, 312 * _TERA, 312 * _TERA),
            2_039 * _GIGA,
            _PCIE4,
        ),
        # H100 SXM5 datasheet: 67 TF fp32, 494.5 TF tf32, 989 TF bf16/fp16 dense (half the
        # sparsity figures); 3.35 TB/s HBM3; PCIe Gen5.
        Device(
            "h100-80gb",
            "NVIDIA H100 80GB HBM3 (SXM)",
            "cuda",
            81_559 * _MIB,
            _flops(67 * _TERA, 494.5 * _TERA, 989 * _TERA, 989 * _TERA),
            3_350 * _GIGA,
            _PCIE5,
        ),
        # H200 SXM datasheet: the H100's compute, 141 GB HBM3e at 4.8 TB/s; PCIe Gen5.
        Device(
            "h200",
            "NVIDIA H200 (SXM, 141GB)",
            "cuda",
            143_771 * _MIB,
            _flops(67 * _TERA, 494.5 * _TERA, 989 * _TERA, 989 * _TERA),
            4_800 * _GIGA,
            _PCIE5,
        ),
        # L4 datasheet: 30.3 TF fp32, 60 TF tf32, 121 TF bf16/fp16 dense (242/120 with
        # sparsity); 24 GB GDDR6 at 300 GB/s; PCIe Gen4 x16.
        Device(
            "l4",
            "NVIDIA L4",
            "cuda",
            23_034 * _MIB,
            _flops(30.3 * _TERA, 60 * _TERA, 121 * _TERA, 121 * _TERA),
            300 * _GIGA,
            _PCIE4,
        ),
        # Ada Lovelace whitepaper (RTX 4090): 82.6 TF fp32, 82.6 TF tf32, 165.2 TF bf16/fp16
        # dense with fp32 accumulation; 24 GB GDDR6X at 1,008 GB/s; PCIe Gen4 x16.
        Device(
            "rtx-4090",
            "NVIDIA GeForce RTX 4090",
            "cuda",
            24_564 * _MIB,
            _flops(82.6 * _TERA, 82.6 * _TERA, 165.2 * _TERA, 165.2 * _TERA),
            1_008 * _GIGA,
            _PCIE4,
        ),
    )
}

#: Other spellings people use, to the built-in name.
_ALIASES = {
    "a100-sxm4-40gb": "a100-40gb",
    "a100-sxm4-80gb": "a100-80gb",
    "h100": "h100-80gb",
    "h100-sxm": "h100-80gb",
    "h200-141gb": "h200",
    "4090": "rtx-4090",
    "rtx4090": "rtx-4090",
}


def known_devices() -> list[str]:
    """The built-in names, sorted."""
    return sorted(DEVICES)


def get_device(name: str | Device) -> Device:
    """The built-in ``Device`` called ``name``, case-insensitive (``"H100-80GB"``); a ``Device``
    is returned as it is. An unknown name raises ``ValueError`` listing the known ones."""
    if isinstance(name, Device):
        return name
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    key = _ALIASES.get(key, key)
    if key not in DEVICES:
        raise ValueError(
            f"unknown device {name!r}; known devices: {', '.join(known_devices())} "
            f"(or describe one: memfit.Device(name, title, 'cuda', capacity_bytes, ...))"
        )
    return DEVICES[key]
