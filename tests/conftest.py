"""Shared test set-up: every test starts with Dynamo's caches empty.

Dynamo keeps compiled code per code object across the whole process, with a limit on how many
versions it keeps; tests wrap many models of the same classes in many modes, so without a reset
a later test could silently run an earlier test's graphs or hit the recompile limit.
"""

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch.compiler.reset()
