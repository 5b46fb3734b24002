"""``memfit bench depth-sweep``: a one-depth sweep writes its files and rewrites only the README's
table between the markers; the table is built from the JSON the sweep wrote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clitools import ROOT, explain, png_size, run_memfit
from memfit.bench.depth_sweep import readme_block, replace_block

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
    proc = run_memfit("bench", "depth-sweep", "--quick", "--depths", "1", "--batch", "2",
                      "--width", "4", "--repeats", "1", "--out", str(out), "--readme", str(readme),
                      cwd=tmp_path)
    assert proc.returncode == 0, explain(proc)
    report = json.loads((out / "depth_sweep_quick.json").read_text())
    (res,) = report["results"]
    assert res["blocks"] == 3 and set(res["methods"]) == {
        "eager", "memfit-none", "memfit-speed", "memfit-memory", "checkpoint_sequential"}
    assert all("peak_bytes" in rec and "time_s" in rec for rec in res["methods"].values())
    height, width = png_size(out / "depth_sweep_quick.png")
    assert height > 300 and width > 800

    text = readme.read_text()
    assert "stale table" not in text and "| 3 | " in text
    assert text.startswith("# project\nintro\n<!-- depth-sweep:begin -->\n")
    assert text.endswith("<!-- depth-sweep:end -->\n![depth sweep](benchmarks/results/"
                         "depth_sweep.png)\n")
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
    assert "new" in replace_block("<!-- depth-sweep_cuda:begin -->\n<!-- depth-sweep_cuda:end -->",
                                  "new", "_cuda")
