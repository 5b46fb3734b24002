"""What is live on the device before a training step starts: its weights and its batch.

``memfit.measure`` reports the peak *above* what was live when the call began, so a question
about the whole device ("does batch n fit in 16 GiB?") adds these bytes back. Each storage is
counted once: tied weights, views of one input, and an input that is a parameter are not counted
twice. A meta tensor holds no memory here; where it stands for a tensor of the device planned for
(``memfit.fit`` on a model built under ``torch.device("meta")``), ``meta=True`` counts the bytes
it will take there, once per tensor object (a meta tensor has no storage that could tell two
views of one apart; the same tensor passed twice, as ``input_ids`` and ``labels``, counts once).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from memfit._compat import tree_flatten

__all__ = ["input_bytes", "resident_bytes"]


def _storages(values: Any, meta: bool) -> dict[Hashable, int]:
    """Bytes of each storage of the tensors in ``values`` (any pytree), keyed by device and
    address; with ``meta``, each meta tensor object's own size."""
    out: dict[Hashable, int] = {}
    for t in tree_flatten(values)[0]:
        if not isinstance(t, torch.Tensor):
            continue
        if t.is_meta:
            if meta:
                out[("meta", id(t))] = t.numel() * t.element_size()
            continue
        s = t.untyped_storage()
        out[(str(t.device), s.data_ptr())] = s.nbytes()
    return out


def resident_bytes(
    model: nn.Module, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
) -> tuple[int, int]:
    """``(parameters and buffers, input tensors)`` bytes, each storage counted once.

    These are live before a step starts, so ``memfit.measure``'s peak (which is *above* what was
    live at entry) does not include them.
    """
    weights = _storages([*model.parameters(), *model.buffers()], meta=False)
    inputs = _storages((tuple(args), dict(kwargs or {})), meta=False)
    return sum(weights.values()), sum(n for p, n in inputs.items() if p not in weights)


def input_bytes(args: Any, kwargs: Any, *, meta: bool = True) -> int:
    """Bytes of a step's input tensors (alive through the step), one count per storage; a meta
    tensor counts the bytes it stands for unless ``meta=False`` (see the module docstring)."""
    return sum(_storages((args, kwargs), meta).values())
