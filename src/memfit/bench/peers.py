"""The ways PyTorch alone trains a model, as modules the benchmarks set beside memfit.

A benchmark is only fair if memfit's peers run the same model in the same step, so the peers'
wrappers live here once, for the depth sweep (``memfit.bench.depth_sweep``) and the budget
frontier (``benchmarks/budget_frontier.py``):

* :class:`SequentialCheckpointed`: eager ``torch.utils.checkpoint.checkpoint_sequential`` over a
  model laid out as ``stem``, ``blocks`` (one ``nn.Sequential``), ``head``, as
  ``memfit.bench.resnet.CifarResNet`` is;
* :class:`SequentialEncoder`: the zoo's transformer in that layout, so the same peer applies;
* :func:`entry_point`: a model behind a ``forward`` of its own, so that several ``torch.compile``
  or memfit wrappers of one model class keep their compiled code apart in Dynamo's cache.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

from memfit.bench.zoo import Encoder

__all__ = ["SequentialCheckpointed", "SequentialEncoder", "entry_point"]


class SequentialCheckpointed(nn.Module):
    """``model.stem``, ``checkpoint_sequential`` over ``model.blocks`` in ``segments``, ``head``.

    ``use_reentrant=False``, the variant PyTorch recommends; it checkpoints every segment but the
    last, so ``segments=1`` is plain eager.
    """

    def __init__(self, model: nn.Module, segments: int) -> None:
        super().__init__()
        self.model = model
        self.segments = segments

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        model: Any = self.model  # any module with stem, blocks and head
        h = model.stem(x)
        h = checkpoint_sequential(model.blocks, self.segments, h, use_reentrant=False)
        return model.head(h)


class SequentialEncoder(nn.Module):
    """The zoo's transformer with its layers in one ``nn.Sequential`` (``blocks``).

    ``nn.TransformerEncoder.forward`` without a mask or final norm runs its layers one after the
    other; holding them in an ``nn.Sequential`` computes the same and lets
    ``checkpoint_sequential`` split them. ``stem``/``head`` mirror ``CifarResNet``'s layout.
    """

    def __init__(self, encoder: Encoder) -> None:
        super().__init__()
        self.stem = nn.Identity()
        self.blocks = nn.Sequential(*encoder.encoder.layers)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))


class _Entry(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any) -> Any:
        return self.inner(*args)


def entry_point(model: nn.Module, tag: str) -> nn.Module:
    """``model`` behind a module whose ``forward`` is a code object of its own, named by ``tag``.

    Dynamo attaches compiled code and its recompile count to the code object of the frame it
    compiles; with one per wrapper, the wrappers' compiled graphs never mix, none counts against
    another's recompile limit, and no ``torch.compiler.reset()`` is needed between them.
    """
    base = _Entry.forward
    name = "forward_" + "".join(c if c.isalnum() else "_" for c in tag)
    code = base.__code__.replace(co_name=name)
    fwd = types.FunctionType(code, base.__globals__, name, base.__defaults__, base.__closure__)
    cls = type(f"Entry_{name}", (_Entry,), {"forward": fwd})
    return cls(model)
