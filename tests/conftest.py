"""Shared test set-up: every test starts with Dynamo's caches empty.

Dynamo keeps compiled code per code object across the whole process, with a limit on how many
versions it keeps; tests wrap many models of the same classes in many modes, so without a reset
a later test could silently run an earlier test's graphs or hit the recompile limit.

Run by ``pytest -n N`` (pytest-xdist, as ``make test`` does), each of the N worker processes
gets its share of the machine's cores for torch's threads, so the workers do not contend for them.
"""

import os

import pytest
import torch

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch.compiler.reset()
