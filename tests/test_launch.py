"""``memfit.pipeline.launch``: K local ranks, results by rank, and no hang when one fails."""

from __future__ import annotations

import os
import time

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
