"""``memfit.pipeline.launch``: K local ranks, results by rank, and no hang when one fails."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from memfit.pipeline import RankError, launch
from pipeline_workers import raises_on_rank_one, sleeps, summed


def test_results_come_back_in_rank_order_with_their_tensors() -> None:
    results = launch(summed, 2, timeout=60)
    # the ranks share the cores, as torchrun's workers do
    assert all(r["threads"] == max(1, (os.cpu_count() or 1) // 2) for r in results)
    assert [int(r["rank"]) for r in results] == [0, 1]
    for r in results:
        assert torch.equal(r["sum"], torch.full((3,), 3.0))


def test_a_rank_that_raises_ends_every_rank_and_is_named() -> None:
    start = time.monotonic()
    with pytest.raises(RankError, match="rank 1 of 3 failed") as info:
        launch(raises_on_rank_one, 3, timeout=30)
    assert info.value.rank == 1 and "boom" in info.value.reason
    assert time.monotonic() - start < 30


def test_a_hang_is_ended_by_the_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(RankError, match="timed out after 3 s"):
        launch(sleeps, 2, timeout=3)
    assert time.monotonic() - start < 15


def test_bad_arguments_are_refused_before_any_process_starts() -> None:
    with pytest.raises(ValueError, match="nprocs"):
        launch(sleeps, 0)
    with pytest.raises(ValueError, match="timeout"):
        launch(sleeps, 2, timeout=0)


def _launched(script: str) -> subprocess.CompletedProcess[str]:
    """``script`` run by a fresh Python (whose resource tracker reports leaks at exit)."""
    tests = Path(__file__).resolve().parent
    path = [str(tests.parent / "src"), str(tests), os.environ.get("PYTHONPATH", "")]
    return subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.slow
def test_a_pipeline_run_leaves_no_semaphore_behind() -> None:
    """Ranks that reported exit on their own, so what they made (``torch.fx``'s progress bar
    makes a multiprocessing lock in each rank) is released; a rank ended by a signal leaves
    its semaphores to the resource tracker, which warns of them when the launcher exits."""
    done = _launched(
        "from memfit.pipeline import launch\n"
        "from pipeline_workers import one_step\n"
        "print(launch(one_step, 2, args=('mlp', 2), timeout=120))\n"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "leaked semaphore" not in done.stderr


@pytest.mark.slow
def test_ranks_ended_after_a_failure_leave_no_semaphore_behind() -> None:
    """A rank the launcher ends while it runs Python leaves by its exit handlers."""
    done = _launched(
        "from memfit.pipeline import RankError, launch\n"
        "from pipeline_workers import locks_and_sleeps\n"
        "try:\n"
        "    launch(locks_and_sleeps, 2, timeout=120)\n"
        "except RankError as e:\n"
        "    print(e)\n"
    )
    assert "rank 1 of 2 failed" in done.stdout, done.stderr[-3000:]
    assert "leaked semaphore" not in done.stderr
