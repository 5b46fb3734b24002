"""Running a model without leaving a trace: buffers and random states put back afterwards.

memfit runs a user's forward to capture it, to profile it, to plan it (``memfit.plan``) or to
make a pipeline stage's example inputs; none of these is a training step, so none may move
BatchNorm's running statistics or advance the random streams later dropout masks come from. A
region recomputed in the backward pass (``execution.regions``) runs its forward a second time,
which must not update them again either.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

__all__ = ["preserved"]


@contextmanager
def preserved(buffers: Iterable[torch.Tensor], random: bool = True) -> Iterator[None]:
    """Restore the values of ``buffers`` and (``random``) the CPU and CUDA random states on exit.

    ``random=False`` leaves the random states to the caller: a region's recomputation
    (``execution.regions``) has ``torch.utils.checkpoint`` replay and restore them.
    """
    saved = [(b, b.detach().clone()) for b in buffers]
    cpu_rng = torch.random.get_rng_state() if random else None
    cuda_rng = torch.cuda.get_rng_state_all() if random and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for buf, value in saved:
                buf.copy_(value)
        if cpu_rng is not None:
            torch.random.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
