"""memfit under DistributedDataParallel and FSDP2 (gloo, 2 processes).

DDP's reducer runs after each parameter's ``AccumulateGrad`` and reads ``.grad``; memfit adds
the gradients of accumulating micro-batches into ``.grad`` inside its backward graph
(``execution.accumulate``), so the reducer must still see every gradient, once, summed as plain
DDP sums it. Dynamo's DDP optimizer splits memfit's graph at bucket boundaries; the step's
prediction must count every graph's parameter gradients (alive while earlier graphs' backwards
run). One launch (a few seconds) checks everything.
"""

from __future__ import annotations

import pytest
import torch

from ddp_workers import accumulate
from memfit.pipeline import launch


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    """What each of the 2 ranks reports; one launch for every test here."""
    return launch(accumulate, 2, args=((None, "none", "memory"),), timeout=120.0)


def test_ddp_with_no_sync_accumulation_equals_plain_ddp_bit_for_bit(ranks: list[dict]) -> None:
    plain = [r[None] for r in ranks]
    for policy in ("none", "memory"):
        got = [r[policy] for r in ranks]
        for rank in range(2):
            for step in range(2):
                for g, h in zip(got[rank]["grads"][step], plain[rank]["grads"][step], strict=True):
                    torch.testing.assert_close(g, h, rtol=0, atol=0)
            # An accumulating micro-batch holds no more than plain DDP's.
            assert got[rank]["peaks"][0] <= 1.02 * plain[rank]["peaks"][0], policy
        # The reducer averaged: both ranks end with the same gradients.
        for g, h in zip(got[0]["grads"][1], got[1]["grads"][1], strict=True):
            torch.testing.assert_close(g, h, rtol=0, atol=0)


def test_ddp_optimizer_splits_and_the_prediction_holds(ranks: list[dict]) -> None:
    for rank in ranks:
        got = rank["predicted"]
        assert got["graphs"] > 1  # the DDP optimizer split the model into buckets
        assert got["measured"] == pytest.approx(got["predicted"], rel=0.10)


def test_fsdp2_around_memfit_blocks_equals_plain_fsdp2(ranks: list[dict]) -> None:
    """``fully_shard`` around ``memfit.checkpoint`` blocks: FSDP2 gathers each block's
    parameters before memfit's graph runs and reduce-scatters after its backward, and the
    forward leaves less for the backward than plain FSDP2's. (Not the step's peak: on two gloo
    ranks it varies by 1 MiB between runs, plain FSDP2's and memfit's alike, which made this
    test fail on its peak 1 time in 2 after the whole suite.)"""
    for rank in ranks:
        plain, got = rank["fsdp2"]["plain"], rank["fsdp2"]["memfit"]
        for g, h in zip(got["grads"], plain["grads"], strict=True):
            torch.testing.assert_close(g, h, rtol=0, atol=0)
        assert got["recomputed"] > 0
        assert got["kept"] < plain["kept"]
