"""``memfit bench depth-sweep``: a one-depth sweep writes its JSON, Markdown and PNG in ``--out``
and nothing anywhere else (the README's table is the repository script's business:
``tests/test_benchmarks_depth_sweep.py``)."""

from __future__ import annotations

from pathlib import Path

from clitools import TINY_SWEEP, check_tiny_sweep, explain, run_memfit


def test_tiny_sweep_writes_results_in_out_only(tmp_path: Path) -> None:
    cwd, tmp, out = tmp_path / "cwd", tmp_path / "tmp", tmp_path / "results"
    cwd.mkdir()
    tmp.mkdir()
    proc = run_memfit("bench", "depth-sweep", *TINY_SWEEP, "--out", str(out), cwd=cwd, tmpdir=tmp)
    assert proc.returncode == 0, explain(proc)
    check_tiny_sweep(out)
    assert sorted(p.name for p in out.iterdir()) == [
        "depth_sweep_quick.json",
        "depth_sweep_quick.md",
        "depth_sweep_quick.png",
    ]
    assert list(cwd.iterdir()) == [] and not (tmp / "memfit-bench").exists()
    assert str(out / "depth_sweep_quick.json") in proc.stdout.replace("\n", "")


def test_no_readme_option() -> None:
    proc = run_memfit("bench", "depth-sweep", "--readme", "README.md")
    assert proc.returncode == 2 and "--readme" in proc.stderr, explain(proc)
