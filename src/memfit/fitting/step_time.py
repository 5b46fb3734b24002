"""An estimated step time on a device not here: a roofline over the plan's FLOPs and bytes.

Why a roofline and not a measurement: the device is not here. The estimate takes the plan's
forward FLOPs three times (the backward costs about twice the forward: a gradient for the
input and one for the weights per matrix product), adds the FLOPs the plan recomputes, and
divides by the device's peak FLOP/s for the compute dtype; memory traffic (each kept
activation written once and read once, the weights read in forward and backward and their
gradients written, the optimizer reading and writing weights, gradients and state) at the
HBM bandwidth bounds it from below; offloaded bytes cross the host link twice, overlapped with
compute. Peak FLOP/s are never reached by a real step, so this is a lower bound, printed and
documented as an estimate; it orders policies (what recomputation costs) more reliably than it
predicts seconds.
"""

from __future__ import annotations

import torch

from memfit.analysis.devices import Device
from memfit.analysis.step_memory import StepMemory
from memfit.planning.plan import Plan

__all__ = ["estimate_step_seconds", "compute_dtype_name"]


def compute_dtype_name(param_dtype: torch.dtype, autocast: torch.dtype | None) -> str:
    """The key of ``Device.flops`` a step's matmuls run at: autocast's dtype, else the weights'
    (fp32 matmuls are counted at fp32, torch's default ``allow_tf32=False``)."""
    return str(autocast or param_dtype).removeprefix("torch.")


def estimate_step_seconds(
    plan: Plan, memory: StepMemory, device: Device, compute_dtype: str
) -> float:
    """Roofline seconds of one training step (forward, backward with recomputation, optimizer)
    under ``plan`` on ``device``; see the module docstring. Raises ``ValueError`` where the
    device has no FLOP/s figure for ``compute_dtype``."""
    flops = 3 * plan.forward_flops + plan.recompute_flops
    compute = flops / device.flops_for(compute_dtype)
    traffic = 2 * plan.kept_bytes + 2 * memory.weights_bytes + memory.gradient_bytes
    passes = max(compute, traffic / device.memory_bandwidth)
    link = 2 * plan.offloaded_bytes / device.host_bandwidth if plan.offloaded_bytes else 0.0
    optimizer = 0.0
    if memory.optimizer != "none":
        moved = 2 * memory.weights_bytes + memory.gradient_bytes + 2 * memory.optimizer_state_bytes
        optimizer = moved / device.memory_bandwidth
    return max(passes, link) + optimizer
