"""What a user asks offload to do (``OffloadOptions``), where it may go, and its errors.

Part of ``memfit.execution.offload``: see its docstring.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from memfit.choice import Choice
from memfit.planning.budget import parse_budget

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


@dataclass(frozen=True)
class OffloadOptions:
    """Where offloaded values go. ``to=None`` picks ``"host"`` on CUDA and ``"disk"`` on CPU.

    ``directory`` is where ``"disk"`` makes its private directory (default: the system temp
    dir). ``bandwidth`` (bytes/s, both directions) replaces the measured link speed (how much of
    a copy hides behind compute still follows ``copy_overlap``): for planning
    on a machine other than the one that runs, and for tests that need a plan independent of
    timing. Values under ``min_bytes`` are never offloaded (four ops and a file per value cost
    more than the bytes they would free). ``host_budget`` (bytes or a size such as ``"8GiB"``)
    caps what one step may hold off the device, in host memory or on disk; plans respect it, and
    a device budget that cannot be met within it is refused before any step runs. Disk offload
    is also capped at 90% of the free space where its directory is, measured when a graph is
    planned.
    """

    to: str | None = None
    directory: str | None = None
    bandwidth: float | None = None
    min_bytes: int = 64 * 1024
    host_budget: int | str | None = None

    def __post_init__(self) -> None:
        if self.to is not None:
            OffloadTarget.parse(self.to, "offload_to", "memfit.OffloadTarget")
        if self.bandwidth is not None and not self.bandwidth > 0:
            raise ValueError(f"offload_bandwidth must be positive bytes/s, got {self.bandwidth!r}")
        if isinstance(self.min_bytes, bool) or not isinstance(self.min_bytes, int):
            raise TypeError(f"offload_min_bytes must be an int, got {self.min_bytes!r}")
        if self.min_bytes < 1:
            raise ValueError(f"offload_min_bytes must be at least 1, got {self.min_bytes}")
        if self.directory is not None:
            check_directory(self.directory)
        if self.host_budget is not None:
            budget = parse_budget(self.host_budget)
            if budget.bytes is None:
                raise ValueError(
                    f"host_budget is an amount of memory (bytes or a size such as '8GiB'), "
                    f"not a fraction: got {self.host_budget!r}"
                )
            object.__setattr__(self, "host_budget", budget.bytes)

    @property
    def host_budget_bytes(self) -> int | None:
        assert self.host_budget is None or isinstance(self.host_budget, int)
        return self.host_budget

    def destination(self, device: torch.device) -> str:
        """The destination for values on ``device``; an error for host offload of CPU values."""
        to = self.to or ("host" if device.type == "cuda" else "disk")
        if to == "host" and device.type != "cuda":
            raise OffloadError(
                f"offload_to='host' moves activations from an accelerator to host memory, but this "
                f"model's activations are on {device.type!r}, already in host memory: use "
                f"memfit.Options(offload_to='disk') (or leave offload_to unset)"
            )
        if to == "disk" and device.type not in ("cpu", "cuda"):
            raise OffloadError(f"offload to disk supports CPU and CUDA tensors, not {device.type}")
        return to


def check_directory(directory: str) -> None:
    """Fail now, before any step runs, if ``directory`` cannot hold offload files."""
    if not os.path.isdir(directory):
        raise OffloadError(f"offload_dir {directory!r} does not exist or is not a directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise OffloadError(f"offload_dir {directory!r} is not writable by this user")
