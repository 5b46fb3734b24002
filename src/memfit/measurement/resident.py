"""What is live on the device before a training step starts: its weights and its batch.

``memfit.measure`` reports the peak *above* what was live when the call began, so a question
about the whole device ("does batch n fit in 16 GiB?") adds these bytes back. Each storage is
counted once: tied weights, views of one input, and an input that is a parameter are not counted
twice, and a meta tensor (no memory) not at all.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from memfit._compat import tree_flatten

__all__ = ["resident_bytes"]


def _storages(tensors: Iterable[Any]) -> dict[int, int]:
    out: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            out[s.data_ptr()] = s.nbytes()
    return out


def resident_bytes(
    model: nn.Module, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
) -> tuple[int, int]:
    """``(parameters and buffers, input tensors)`` bytes, each storage counted once.

    These are live before a step starts, so ``memfit.measure``'s peak (which is *above* what was
    live at entry) does not include them.
    """
    weights = _storages([*model.parameters(), *model.buffers()])
    inputs = _storages(tree_flatten((tuple(args), dict(kwargs or {})))[0])
    return sum(weights.values()), sum(n for p, n in inputs.items() if p not in weights)
