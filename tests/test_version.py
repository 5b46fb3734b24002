"""The version is one fact: ``memfit.__version__``, which pyproject.toml reads and CHANGELOG.md's
latest release names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import memfit

ROOT = Path(__file__).resolve().parents[1]


def test_the_version_is_the_changelogs_latest_release() -> None:
    releases = re.findall(r"^## (\d+\.\d+\.\d+)", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert releases, "CHANGELOG.md has no '## X.Y.Z' heading"
    assert memfit.__version__ == releases[0]


def test_pyproject_reads_the_version_from_memfit() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "memfit.__version__"
