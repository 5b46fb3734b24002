"""``benchmarks/depth_sweep.py``, the repository's script for the depth sweep: a one-depth sweep
writes its files and rewrites only the README's table between the markers; the table is built
from the JSON the sweep wrote.

The script is not part of the package, so it is loaded from its file (``runpy``) and run as a
developer runs it, with the Python memfit is installed in.
"""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from clitools import ROOT, TINY_SWEEP, check_tiny_sweep, cli_env, explain

SCRIPT = ROOT / "benchmarks" / "depth_sweep.py"
_SCRIPT = runpy.run_path(str(SCRIPT))  # not as __main__: defines, runs nothing
readme_block = _SCRIPT["readme_block"]
replace_block = _SCRIPT["replace_block"]

README = """# project
intro
<!-- depth-sweep:begin -->
stale table
<!-- depth-sweep:end -->
![depth sweep](benchmarks/results/depth_sweep.png)
"""


def test_tiny_sweep_writes_results_and_the_readme_table(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(README)
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *TINY_SWEEP, "--out", str(out), "--readme", str(readme)],
        env=cli_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, explain(proc)
    report = check_tiny_sweep(out)

    text = readme.read_text()
    assert "stale table" not in text and "| 3 | " in text
    assert text.startswith("# project\nintro\n<!-- depth-sweep:begin -->\n")
    assert text.endswith(
        "<!-- depth-sweep:end -->\n![depth sweep](benchmarks/results/depth_sweep.png)\n"
    )
    assert readme_block(report) in text


def test_readme_block_from_the_committed_sweep() -> None:
    report = json.loads((ROOT / "benchmarks/results/depth_sweep.json").read_text())
    block = readme_block(report)
    rows = [line for line in block.splitlines() if line.startswith("| ") and "|---" not in line]
    assert len(rows) == 1 + len(report["results"])  # header + one row per depth
    first = report["results"][0]
    eager = first["methods"]["eager"]["peak_bytes"]
    memory = first["methods"]["memfit-memory"]["peak_bytes"]
    assert f"| {eager / 2**20:.1f} MiB |" in rows[1] and f"{memory / eager:.2f}" in rows[1]


def test_replace_block_needs_both_markers_in_order() -> None:
    assert replace_block(README, "new").count("new") == 1
    for broken in ("no markers", "<!-- depth-sweep:end -->\n<!-- depth-sweep:begin -->"):
        with pytest.raises(ValueError, match="markers"):
            replace_block(broken, "new")
    assert "new" in replace_block(
        "<!-- depth-sweep_cuda:begin -->\n<!-- depth-sweep_cuda:end -->", "new", "_cuda"
    )
