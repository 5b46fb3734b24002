"""README.md's Python blocks run as written, in order, as a user pastes them into one session."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def blocks() -> list[str]:
    return BLOCK.findall(README.read_text())


def test_the_readme_has_python_blocks() -> None:
    # the check below cannot pass by finding nothing
    assert len(blocks()) >= 3 and "memfit.checkpoint(model" in "".join(blocks())


@pytest.mark.slow
def test_the_readme_code_runs() -> None:
    script = "\n".join(blocks())
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "predicted" in done.stdout
