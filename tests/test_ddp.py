"""memfit under DistributedDataParallel (gloo, 2 processes) with gradient accumulation.

DDP's reducer runs after each parameter's ``AccumulateGrad`` and reads ``.grad``; memfit adds
the gradients of accumulating micro-batches into ``.grad`` inside its backward graph
(``execution.accumulate``), so the reducer must still see every gradient, once, summed as plain
DDP sums it. One launch (a few seconds) checks both policies against plain DDP.
"""

from __future__ import annotations

import torch

from ddp_workers import accumulate
from memfit.pipeline import launch


def test_ddp_with_no_sync_accumulation_equals_plain_ddp_bit_for_bit() -> None:
    ranks = launch(accumulate, 2, args=((None, "none", "memory"),), timeout=120.0)
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
