"""Where a benchmark ran: machine, software and load, recorded next to every result.

Benchmarks on a shared 2-core machine are only comparable when the file says what else was
running and which memfit commit produced them, so every benchmark writes these same fields.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

import memfit

__all__ = ["machine_info", "software_info", "load_average", "report"]


def machine_info(device: torch.device | None = None) -> dict[str, Any]:
    """Host, CPU model, thread settings and the GPU in use, if any."""
    info: dict[str, Any] = {
        "node": platform.node(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "gpu": None,
    }
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            info["cpu_model"] = names[0]
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(
            device if device is not None and device.type == "cuda" else 0
        )
    return info


def software_info(root: Path | None = None) -> dict[str, Any]:
    """Python, torch and memfit versions; the git commit of ``root`` (default: the cwd)."""
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "memfit": memfit.__version__,
    }
    try:
        git = ["git"] if root is None else ["git", "-C", str(root)]
        info["git_commit"] = subprocess.run(
            git + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            git + ["status", "--porcelain", "--", "src/memfit"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
        info["memfit_uncommitted_changes"] = [line.strip() for line in dirty]
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


def load_average() -> list[float] | None:
    """1, 5 and 15-minute load averages (None where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def report(
    benchmark: str,
    root: Path,
    started: float,
    load_start: list[float] | None,
    models: list[dict[str, Any]],
    **parameters: Any,
) -> dict[str, Any]:
    """A benchmark's JSON record: its name, the date, machine, software and thread count, its
    ``parameters``, the load average at ``started`` (``time.perf_counter()``) and now, the
    runtime since, and its ``models``' results."""
    return {
        "benchmark": benchmark,
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "software": software_info(root),
        "threads": torch.get_num_threads(),
        **parameters,
        "load_average": {"start": load_start, "end": load_average()},
        "total_runtime_s": round(time.perf_counter() - started, 1),
        "models": models,
    }


# ----------------------------------------------------------------------------------- one depth
