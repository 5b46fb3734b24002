"""``memfit demo`` runs end to end: what ``make demo`` shows a new user must not rot.

Runs the demo's ``--quick`` configuration in a subprocess (as a user would run it, with the
package importable from ``src``), then checks the exit status, that the printed table has a row
per policy with its measured peak, and that the figure is a real PNG of a sensible size.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from clitools import explain, png_size, run_memfit


def test_demo_quick_prints_a_row_per_mode_and_writes_the_figure(tmp_path: Path) -> None:
    out = tmp_path / "demo-out"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    proc = run_memfit("demo", "--quick", "--out", str(out), cwd=cwd)
    assert proc.returncode == 0, explain(proc)

    # What a new user sees is memfit's result, not memfit's warnings about its own example (a loss
    # it cannot see, a swap that offloads nothing) nor the profiler's notes.
    shown = proc.stdout + proc.stderr
    assert "Warning" not in shown and "USDT" not in shown, shown

    # swap hides copies behind compute, which only CUDA's copy engines do: shown there only
    expected = {"none", "speed", "memory", "budget 80%"}
    rows = {}
    for line in proc.stdout.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃]", line) if c.strip()]
        if cells and cells[0] in (*expected, "swap"):
            rows[cells[0]] = cells
    assert set(rows) == expected, proc.stdout
    for cells in rows.values():
        assert cells[1].endswith(("MiB", "KiB")), cells  # measured peak
        # ratios: the peak to plain PyTorch's (measured, its own row) and to none, time to none
        assert cells[2].endswith("x") and cells[3].endswith("x") and cells[6].endswith("x"), cells
    assert rows["none"][3] == "1.00x"
    assert "plain PyTorch" in proc.stdout
    peak = {policy: float(cells[1].split()[0]) for policy, cells in rows.items()}
    assert peak["memory"] < peak["none"], peak
    assert peak["budget 80%"] <= 0.8 * peak["none"] + 0.1, peak  # the budget holds, measured

    png = out / "demo.png"
    assert png.is_file(), proc.stdout
    # --out is honoured (tests/test_cli_out.py checks the other commands and the default folder)
    assert sorted(p.name for p in out.iterdir()) == ["demo.png"]
    assert list(cwd.iterdir()) == [], "demo wrote into its working directory"
    height, width = png_size(png)
    assert height > 300 and width > 600, (height, width)
    assert str(png) in proc.stdout.replace("\n", "")
    assert "Next:" in proc.stdout


def test_demo_help_has_an_example() -> None:
    proc = run_memfit("demo", "--help")
    assert proc.returncode == 0, explain(proc)
    assert "examples:" in proc.stdout and "memfit demo" in proc.stdout


def test_demo_defaults_to_a_folder_in_the_temporary_directory() -> None:
    from memfit.cli.demo import DEFAULT_OUT

    assert DEFAULT_OUT.parent == Path(tempfile.gettempdir()) and DEFAULT_OUT.name == "memfit-demo"
