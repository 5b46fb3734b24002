"""``python -m memfit.demo`` runs end to end: what ``make demo`` shows a new user must not rot.

Runs the demo's ``--quick`` configuration in a subprocess (as a user would run it, with the
package importable from ``src``), then checks the exit status, that the printed table names every
mode, and that the figure is a real PNG of a sensible size.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"


def _read_png(path: Path):
    try:
        from PIL import Image
    except ImportError:
        import matplotlib.image

        return matplotlib.image.imread(path).shape[:2]
    with Image.open(path) as im:
        im.load()
        return im.size[1], im.size[0]


def test_demo_quick_runs_and_writes_a_figure(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    env["MPLBACKEND"] = "Agg"
    # Spinning OpenMP threads make CPU steps many times slower on a busy (CI) machine.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    out = tmp_path / "demo-out"
    proc = subprocess.run(
        [sys.executable, "-m", "memfit.demo", "--quick", "--out", str(out)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"demo failed:\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"

    table_rows = [line for line in proc.stdout.splitlines() if "MiB" in line]
    for mode in ("none", "speed", "memory"):
        assert any(mode in row for row in table_rows), (mode, proc.stdout)

    png = out / "demo.png"
    assert png.is_file(), proc.stdout
    height, width = _read_png(png)
    assert height > 200 and width > 200, (height, width)
    assert str(png) in proc.stdout.replace("\n", "")
