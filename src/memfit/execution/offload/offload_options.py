"""What a user asks offload to do (``OffloadOptions``, the offload fields of ``memfit.Options``),
where it may go, and its errors.

Part of ``memfit.execution.offload``: see its docstring.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

import torch

from memfit.choice import Choice
from memfit.planning.budget import parse_budget
from memfit.planning.offload import MIN_OFFLOAD_BYTES

__all__ = [
    "OffloadTarget",
    "OffloadError",
    "OffloadOptions",
    "check_directory",
]


class OffloadTarget(Choice):
    """Where offloaded activations go."""

    #: pinned host memory (CUDA activations)
    HOST = "host"
    #: files in a private directory, removed as they are read back
    DISK = "disk"


class OffloadError(RuntimeError):
    """Offloading cannot work as asked: a bad directory, a full disk, host offload without CUDA."""


@dataclass(frozen=True, kw_only=True)
class OffloadOptions:
    """The offload fields of ``memfit.Options``, its subclass: each defined, defaulted and checked
    here alone (the default size from ``planning.offload``), so that the offloader
    (``Offloader``) reads them without the rest of the options.

    Plans respect ``host_budget``, and a device budget that cannot be met within it is refused
    before any step runs. Disk offload is also capped at 90% of the free space where its
    directory is, measured when a graph is planned.
    """

    #: Where offloaded values go: ``"host"`` (CUDA activations to pinned host memory) or
    #: ``"disk"``; None picks host on CUDA, disk on CPU.
    offload_to: OffloadTarget | str | None = None
    #: The directory in which disk offload makes its private directory (default: the system
    #: temp dir). Its files are removed as they are read back.
    offload_dir: str | None = None
    #: Bytes/s (both directions) to plan offload with instead of the link speed measured on this
    #: machine (to plan for another machine, or to make a plan independent of timing); how much
    #: of a copy hides behind compute still follows ``copy_overlap``.
    offload_bandwidth: float | None = None
    #: Values smaller than this are never offloaded (a copy and a file cost more than they free).
    offload_min_bytes: int = MIN_OFFLOAD_BYTES
    #: Bytes (or a size such as ``"8GiB"``) one step may hold off the device, in host memory or
    #: on disk; a device budget that cannot be met within it is refused before any step runs.
    host_budget: int | str | None = None

    def __post_init__(self) -> None:
        if self.offload_to is not None:
            to = OffloadTarget.parse(self.offload_to, "offload_to", "memfit.OffloadTarget")
            object.__setattr__(self, "offload_to", to)
        if self.offload_bandwidth is not None and not self.offload_bandwidth > 0:
            raise ValueError(
                f"offload_bandwidth must be positive bytes/s, got {self.offload_bandwidth!r}"
            )
        min_bytes = self.offload_min_bytes
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int):
            raise TypeError(f"offload_min_bytes must be an int, got {min_bytes!r}")
        if min_bytes < 1:
            raise ValueError(f"offload_min_bytes must be at least 1, got {min_bytes}")
        if self.offload_dir is not None:
            check_directory(self.offload_dir)
        _bytes_of(self.host_budget)  # checked now, before any step runs

    @property
    def offload_given(self) -> bool:
        """Whether any offload field differs from its default (they need offloading on)."""
        return any(getattr(self, f.name) != f.default for f in fields(OffloadOptions))

    @property
    def host_budget_bytes(self) -> int | None:
        """``host_budget`` in bytes (None: no cap)."""
        return _bytes_of(self.host_budget)

    def offload_destination(self, device: torch.device) -> str:
        """The destination for values on ``device``; an error for host offload of CPU values."""
        to = str(self.offload_to or ("host" if device.type == "cuda" else "disk"))
        if to == "host" and device.type != "cuda":
            raise OffloadError(
                f"offload_to='host' moves activations from an accelerator to host memory, but this "
                f"model's activations are on {device.type!r}, already in host memory: use "
                f"memfit.Options(offload_to='disk') (or leave offload_to unset)"
            )
        if to == "disk" and device.type not in ("cpu", "cuda"):
            raise OffloadError(f"offload to disk supports CPU and CUDA tensors, not {device.type}")
        return to


def _bytes_of(host_budget: int | str | None) -> int | None:
    if host_budget is None:
        return None
    budget = parse_budget(host_budget)
    if budget.bytes is None:
        raise ValueError(
            f"host_budget is an amount of memory (bytes or a size such as '8GiB'), "
            f"not a fraction: got {host_budget!r}"
        )
    return budget.bytes


def check_directory(directory: str) -> None:
    """Fail now, before any step runs, if ``directory`` cannot hold offload files."""
    if not os.path.isdir(directory):
        raise OffloadError(f"offload_dir {directory!r} does not exist or is not a directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise OffloadError(f"offload_dir {directory!r} is not writable by this user")
