"""Every command writes only where it is told: ``--out``, or without it a folder in the temporary
directory, and never into the working directory it is run from.

Each command runs as a user runs it (a subprocess, quick settings) in an empty working directory,
with ``TMPDIR`` pointing at a folder of the test's own, so the defaults can be checked without
touching the machine's real temporary directory. ``demo``, the slowest, is run once, with ``--out``,
in tests/test_cli_demo.py, which also checks its default folder.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from clitools import ROOT, TINY_SWEEP, explain, run_memfit

#: Per command: its arguments (quick settings), the folder it defaults to in the temporary
#: directory, and the files it must write there.
COMMANDS = {
    "profile": (
        [
            "profile",
            f"{ROOT / 'tests' / 'cli_factories.py'}:tiny_mlp",
            "--device",
            "cpu",
            "--policies",
            "none",
            "--timing-runs",
            "1",
            "--json",
        ],
        "memfit-profile",
        ["profile.json", "timeline.png"],
    ),
    "bench": (
        ["bench", "depth-sweep", *TINY_SWEEP],
        "memfit-bench",
        ["depth_sweep_quick.json", "depth_sweep_quick.md", "depth_sweep_quick.png"],
    ),
}


def _dirs(tmp_path: Path) -> tuple[Path, Path]:
    cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    tmp.mkdir()
    return cwd, tmp


@pytest.mark.parametrize("command", list(COMMANDS))
def test_default_out_is_in_the_temporary_directory(command: str, tmp_path: Path) -> None:
    args, folder, files = COMMANDS[command]
    cwd, tmp = _dirs(tmp_path)
    proc = run_memfit(*args, cwd=cwd, tmpdir=tmp)
    assert proc.returncode == 0, explain(proc)
    assert list(cwd.iterdir()) == [], "the command wrote into its working directory"
    out = tmp / folder
    assert sorted(p.name for p in out.iterdir()) == files
    assert str(out / files[0]) in proc.stdout.replace("\n", "")  # it says where the files went


@pytest.mark.parametrize("command", ["profile"])  # bench: test_cli_bench.py, demo: test_cli_demo.py
def test_out_is_honoured(command: str, tmp_path: Path) -> None:
    args, folder, files = COMMANDS[command]
    cwd, tmp = _dirs(tmp_path)
    out = tmp_path / "out"
    proc = run_memfit(*args, "--out", str(out), cwd=cwd, tmpdir=tmp)
    assert proc.returncode == 0, explain(proc)
    assert sorted(p.name for p in out.iterdir()) == files
    assert list(cwd.iterdir()) == [] and not (tmp / folder).exists()
