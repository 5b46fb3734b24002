"""Running ``memfit`` as a user does, in a subprocess, for the CLI tests; and reading its PNGs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


def run_memfit(*args: str, cwd: Path = ROOT, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(memfit_command(*args), env=cli_env(), cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def start_memfit(*args: str, cwd: Path = ROOT, unset: tuple[str, ...] = ()) -> subprocess.Popen:
    env = {k: v for k, v in cli_env().items() if k not in unset}
    return subprocess.Popen(memfit_command(*args), env=env, cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


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
