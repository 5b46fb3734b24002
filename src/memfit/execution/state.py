"""Running a model without leaving a trace: buffers and random states put back afterwards.

memfit runs a user's forward to capture it, to profile it, to plan it (``memfit.plan``) or to
make a pipeline stage's example inputs; none of these is a training step, so none may move
BatchNorm's running statistics or advance the random streams later draws come from. A region
recomputed in the backward pass (``execution.regions``) runs its forward a second time, which
must not update them again either, and must draw what the forward drew.

NOTE [ Random streams a forward draws from ]
A model's forward draws from torch's generators (dropout: the CPU one and each CUDA device's) and,
in its own Python, from Python's ``random`` and numpy's global ``numpy.random`` (wav2vec2's
SpecAugment masks: ``np.random.rand``, ``np.random.choice``). A run that is not the user's step
restores all four (``RandomStates``), so the step's draws are plain PyTorch's; numpy's only where
the model's process has imported it (``sys.modules``): memfit never imports it for this. A
``torch.Generator`` the model owns (``torch.rand(..., generator=self.g)``) is found where a
module holds it as an attribute, or a region's call is passed it (``owned_generators``), and
restored too. Generators found nowhere (one held in a global or a closure, a
``numpy.random.Generator`` or ``random.Random`` instance) are not: a model drawing from one is
exact under memfit wherever its Python runs once a step (no region recomputed: ``"none"``,
``"speed"``, offload), but a region's recomputation draws from it again.
"""

from __future__ import annotations

import random as _random
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn

__all__ = ["RandomStates", "owned_generators", "preserved"]


def owned_generators(modules: Iterable[nn.Module]) -> list[torch.Generator]:
    """The ``torch.Generator`` objects ``modules`` hold as attributes (a model that draws its
    own masks from its own generator, ``torch.rand(..., generator=self.g)``)."""
    found: dict[int, torch.Generator] = {}
    for module in modules:
        for value in module.__dict__.values():
            if isinstance(value, torch.Generator):
                found[id(value)] = value
    return list(found.values())


class RandomStates:
    """The random states a forward draws from, taken now: torch's CPU generator and each
    initialised CUDA device's (``torch_streams``), Python's ``random`` and numpy's global
    ``numpy.random`` if numpy is imported (``python``), and the ``generators`` given (the
    model's own). ``restore`` puts them back."""

    __slots__ = ("cpu", "cuda", "python", "numpy", "generators")

    def __init__(
        self,
        torch_streams: bool = True,
        python: bool = True,
        generators: Iterable[torch.Generator] = (),
    ) -> None:
        self.generators = [(g, g.get_state()) for g in generators]
        self.cpu = torch.random.get_rng_state() if torch_streams else None
        self.cuda = (
            torch.cuda.get_rng_state_all()
            if torch_streams and torch.cuda.is_initialized()
            else None
        )
        self.python = _random.getstate() if python else None
        np: Any = sys.modules.get("numpy") if python else None
        self.numpy = (np, np.random.get_state()) if np is not None else None

    def restore(self) -> None:
        """Set every state taken back to its value when taken."""
        if self.cpu is not None:
            torch.random.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        if self.python is not None:
            _random.setstate(self.python)
        if self.numpy is not None:
            np, state = self.numpy
            np.random.set_state(state)
        for generator, value in self.generators:
            generator.set_state(value)


@contextmanager
def preserved(
    buffers: Iterable[torch.Tensor],
    random: bool = True,
    generators: Iterable[torch.Generator] = (),
) -> Iterator[None]:
    """Restore the values of ``buffers`` and (``random``) every global random state a forward
    draws from (``RandomStates``: torch's CPU and CUDA, Python's, numpy's) and the states of
    ``generators`` (the model's own: ``owned_generators``) on exit.

    ``random=False`` leaves the random states to the caller: a region's recomputation
    (``execution.regions``) has ``torch.utils.checkpoint`` replay and restore torch's, and
    replays and restores Python's and numpy's itself.
    """
    saved = [(b, b.detach().clone()) for b in buffers]
    states = RandomStates(generators=generators) if random else None
    try:
        yield
    finally:
        with torch.no_grad():
            for buf, value in saved:
                buf.copy_(value)
        if states is not None:
            states.restore()
