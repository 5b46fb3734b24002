"""Running ``memfit`` as a user does, in a subprocess, for the CLI tests; and reading its PNGs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    env["MPLBACKEND"] = "Agg"
    # Spinning OpenMP threads make CPU steps many times slower on a busy (CI) machine.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def memfit_command(*args: str) -> list[str]:
    """``python -m memfit ARGS``: the ``memfit`` script's code, without needing it installed."""
    return [sys.executable, "-m", "memfit", *args]


def run_memfit(
    *args: str, cwd: Path = ROOT, timeout: float = 300, tmpdir: Path | None = None
) -> subprocess.CompletedProcess:
    """``memfit ARGS`` in ``cwd``; ``tmpdir`` becomes its temporary directory (``TMPDIR``)."""
    env = cli_env() if tmpdir is None else {**cli_env(), "TMPDIR": str(tmpdir)}
    return subprocess.run(
        memfit_command(*args), env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def start_memfit(*args: str, cwd: Path = ROOT, unset: tuple[str, ...] = ()) -> subprocess.Popen:
    env = {k: v for k, v in cli_env().items() if k not in unset}
    return subprocess.Popen(
        memfit_command(*args),
        env=env,
        cwd=cwd,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


#: The smallest depth sweep: one depth (3 blocks), tiny model, one timed round.
TINY_SWEEP = ("--quick", "--depths", "1", "--batch", "2", "--width", "4", "--repeats", "1")


def check_tiny_sweep(out: Path) -> dict[str, Any]:
    """Assert that ``out`` holds the results of :data:`TINY_SWEEP`; return its JSON report."""
    report = json.loads((out / "depth_sweep_quick.json").read_text())
    (res,) = report["results"]
    assert res["blocks"] == 3 and set(res["methods"]) == {
        "eager",
        "memfit-none",
        "memfit-speed",
        "memfit-memory",
        "checkpoint_sequential",
    }
    assert all("peak_bytes" in rec and "time_s" in rec for rec in res["methods"].values())
    height, width = png_size(out / "depth_sweep_quick.png")
    assert height > 300 and width > 800
    return report


def png_size(path: Path) -> tuple[int, int]:
    """(height, width) of a PNG, read by an image library (so it is a real image)."""
    try:
        from PIL import Image
    except ImportError:
        import matplotlib.image

        return matplotlib.image.imread(path).shape[:2]
    with Image.open(path) as im:
        im.load()
        return im.size[1], im.size[0]


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
