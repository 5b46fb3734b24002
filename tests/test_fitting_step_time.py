"""memfit.fitting.step_time: the roofline estimate, on literal plans and devices."""

from __future__ import annotations

import pytest
import torch

from memfit.analysis.devices import Device
from memfit.analysis.step_memory import StepMemory
from memfit.fitting.step_time import compute_dtype_name, estimate_step_seconds
from memfit.planning.plan import GraphPlan, Plan


def _plan(forward_flops: int, recompute_flops: int, kept_bytes: int) -> Plan:
    graph = GraphPlan(
        policy="memory", decisions={}, kept=(), recomputed=(), kept_bytes=kept_bytes,
        predicted_peak_bytes=0, baseline_peak_bytes=0, baseline_kept_bytes=kept_bytes,
        recompute_flops=recompute_flops, forward_flops=forward_flops, num_nodes=1,
    )  # fmt: skip
    return Plan("memory", (graph,))


DEVICE = Device("d", "a device", "cuda", 2**30, {"bfloat16": 1e12, "float32": 1e11}, 1e9, 1e8)


def test_compute_bound_step_counts_three_forwards_and_the_recomputation() -> None:
    memory = StepMemory(0, 0, 0, 0)
    seconds = estimate_step_seconds(_plan(10**12, 5 * 10**11, 0), memory, DEVICE, "bfloat16")
    assert seconds == pytest.approx(3.5)
    slower = estimate_step_seconds(_plan(10**12, 0, 0), memory, DEVICE, "float32")
    assert slower == pytest.approx(30.0)


def test_memory_bound_step_and_the_optimizer_traffic() -> None:
    memory = StepMemory(10**9, 10**9, 2 * 10**9, 0, "adamw", "foreach")
    # passes: 2 x kept + 2 x weights + gradients = 5e9 B at 1e9 B/s; optimizer: 2 + 1 + 4 = 7e9 B
    seconds = estimate_step_seconds(_plan(1, 0, 10**9), memory, DEVICE, "bfloat16")
    assert seconds == pytest.approx(5.0 + 7.0)
    with pytest.raises(ValueError, match="no FLOP/s figure for float16"):
        estimate_step_seconds(_plan(1, 0, 0), memory, DEVICE, "float16")


def test_the_compute_dtype() -> None:
    assert compute_dtype_name(torch.float32, torch.bfloat16) == "bfloat16"
    assert compute_dtype_name(torch.bfloat16, None) == "bfloat16"
    assert compute_dtype_name(torch.float32, None) == "float32"
