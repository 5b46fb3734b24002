"""The measured link: how fast a copy out and back runs, and how much of it overlaps compute.

Part of ``memfit.execution.offload``: see its docstring.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from memfit.analysis.transfers import Link
from memfit.execution.offload.store import OffloadStore
from memfit.measurement.timing import synchronize

__all__ = [
    "copy_overlap",
    "measure_link",
]


# ---- the link --------------------------------------------------------------------------------


_LINKS: dict[tuple[str, str, str | None, int], Link] = {}


def measure_link(to: str, device: torch.device, directory: str | None = None) -> Link:
    """The link to ``to`` for values on ``device``, measured once per process and thread count.

    Bandwidth out and in (32 MiB round trips) and latency per copy (4 KiB round trips) are
    measured through the store itself (its threads, files or pinned arena), medians of three.
    ``overlap`` (the fraction of copying that hides behind compute) follows from where the copies
    run (``copy_overlap``).
    """
    key = (to, str(device), directory, torch.get_num_threads())
    if key in _LINKS:
        return _LINKS[key]
    store = OffloadStore(to, directory)
    try:
        big = torch.ones(32 * 2**20 // 4, dtype=torch.float32, device=device)
        small = torch.ones(1024, dtype=torch.float32, device=device)
        out_s, in_s = _round_trips(store, big, device)
        small_out, small_in = _round_trips(store, small, device)
        nbytes = big.numel() * big.element_size()
        latency = (small_out + small_in) / 2
        link = Link(
            out_bytes_per_s=nbytes / max(out_s - latency, 1e-9),
            in_bytes_per_s=nbytes / max(in_s - latency, 1e-9),
            latency_s=latency,
            overlap=copy_overlap(device),
        )
    finally:
        store.close()
    _LINKS[key] = link
    return link


def copy_overlap(device: torch.device) -> float:
    """The fraction of a copy's time that runs beside compute on ``device``.

    On CUDA the copies run on the copy engines, on side streams, beside the kernels: 1. On a CPU
    the store's threads copy on the same cores that compute: only the cores torch's intra-op
    threads leave idle can hide them. Measured on this project's 2-core machine (ResNet, 92 MiB
    offloaded per step to disk): with 2 torch threads a step took 1.65x plain and its copies hid
    behind nothing; with 1 thread, 1.18x. Trying to measure the overlap directly (copies beside a
    matrix-product loop) gave anything from 0.06 to 0.92 from run to run on that machine, so the
    rule is used instead of a number that noisy.
    """
    if device.type == "cuda":
        return 1.0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(0.0, 1.0 - torch.get_num_threads() / max(cores or 1, 1))


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def _round_trips(store: OffloadStore, x: torch.Tensor, device: torch.device) -> tuple[float, float]:
    outs, ins = [], []
    keys: list[int] = []

    def out() -> None:
        keys.append(store.offload(x))
        store.wait_out(keys[-1])

    def back() -> None:
        store.reload_wait(keys[-1])

    for _ in range(3):
        outs.append(_timed(out, device))
        ins.append(_timed(back, device))
    return sorted(outs)[1], sorted(ins)[1]
