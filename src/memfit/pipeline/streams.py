"""Per-stage random streams, for a rank that runs several stages.

A rank that holds one stage draws its dropout masks from its own generator, micro-batch after
micro-batch: the masks that running the stages one after another in one process, each seeded as
its rank is, would draw. A rank that holds several stages runs them interleaved in the
schedule's order, so one generator would hand each stage numbers that depend on the schedule.
``OwnStream`` gives each stage its own stream instead: every step, each of the rank's stages
starts from the rank's generator as it is when the step starts, and continues, micro-batch after
micro-batch, only through that stage's own forwards. The masks are then those of running every
stage in one process, each seeded as its rank is, whatever the schedule.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

__all__ = ["OwnStream", "rng_state", "set_rng_state"]


def rng_state(device: torch.device) -> torch.Tensor:
    """The state of the generator that draws on ``device``."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class OwnStream(nn.Module):
    """``stage`` drawing from a stream of its own (``start`` sets it; the rank's generator is
    left as it was)."""

    def __init__(self, stage: nn.Module, device: torch.device) -> None:
        super().__init__()
        self.stage = stage
        self.device = device
        self.state: torch.Tensor | None = None

    def start(self) -> None:
        """Begin this stage's stream from the rank's generator as it is now."""
        self._keep(rng_state(self.device))

    def _keep(self, state: torch.Tensor) -> None:
        # into the same tensor from the first step on: a step allocates no state that outlives
        # it, so what the step holds is only what the pipeline's memory model counts
        if self.state is None or self.state.shape != state.shape:
            self.state = state
        else:
            self.state.copy_(state)

    def forward(self, *args: Any) -> Any:
        if self.state is None:
            return self.stage(*args)
        outer = rng_state(self.device)
        set_rng_state(self.device, self.state)
        try:
            out = self.stage(*args)
            self._keep(rng_state(self.device))
        finally:
            set_rng_state(self.device, outer)
        return out
