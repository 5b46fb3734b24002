"""The activations' plan of one training step at a given size, for the device planned for.

Why one function: ``plan_step`` is the only place the fit search calls ``memfit.plan``. A model
built under ``torch.device("meta")`` (a 7B model in under a second, no memory) is planned on
fake tensors for the target's device type, ``memfit.plan(..., device="cuda")``; a real model is
planned where it lives. Whether a model is meta is ``execution.fake_target.is_meta``, the same
test ``memfit.plan`` makes; the bytes of the inputs, ``measurement.resident.input_bytes``.

``with_size`` makes the inputs of another batch size or sequence length from the example
inputs, along one dimension: a real tensor's rows are repeated (``index_select``), a meta tensor
is made empty at the new shape; tensors whose size along that dimension is not the example's
(a mask shared by all rows, a scalar) are left alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from memfit._compat import tree_flatten, tree_map
from memfit.execution.fake_target import is_meta
from memfit.execution.module import plan as memfit_plan
from memfit.planning.plan import Plan
from memfit.planning.policy import Policy

__all__ = ["plan_step", "with_size", "size_of"]


def plan_step(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    policy: Policy,
    device_type: str,
    autocast: torch.dtype | None = None,
) -> Plan:
    """``memfit.plan`` of ``model`` on these inputs under ``policy`` (see the module docstring).

    ``device_type`` is the target's (``"cuda"``): a meta model is planned for it; a real model
    is planned on the device it is on. ``autocast``: the step runs under ``torch.autocast`` with
    this compute dtype (weights stay in theirs).
    """
    meta = is_meta(model, (args, kwargs))
    where = device_type if meta else _device_type_of(model, args, kwargs)
    cast: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if autocast is not None:
        # A meta model is planned on CPU stand-ins of the target's tensors (memfit.execution.
        # fake_target), so their ops dispatch through CPU autocast: cast there as the target would.
        cast = _autocast("cpu" if meta else where, autocast)
    torch.compiler.reset()  # each size is a capture of its own; no recompile limit reached
    with cast:
        if meta:
            return memfit_plan(model, *args, policy=policy, device=device_type, **kwargs)
        return memfit_plan(model, *args, policy=policy, **kwargs)


@contextlib.contextmanager
def _autocast(device_type: str, dtype: torch.dtype) -> Iterator[None]:
    """``torch.autocast(device_type, dtype)``, also for ``"cuda"`` on a machine without one.

    ``torch.autocast("cuda")`` disables itself with a warning where CUDA is not available, but
    a meta model planned for CUDA runs on fake CUDA tensors here, and its plan must see the
    casts a GPU's step makes. So the autocast state is set with torch's public setters, as
    ``torch.autocast.__enter__`` sets it, and put back after.
    """
    enabled = torch.is_autocast_enabled(device_type)
    previous = torch.get_autocast_dtype(device_type)
    torch.set_autocast_enabled(device_type, True)
    torch.set_autocast_dtype(device_type, dtype)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled(device_type, enabled)
        torch.set_autocast_dtype(device_type, previous)


def _device_type_of(model: nn.Module, args: Any, kwargs: Any) -> str:
    for t in [*model.parameters(), *tree_flatten((args, kwargs))[0]]:
        if isinstance(t, torch.Tensor):
            return t.device.type
    return "cpu"


def size_of(args: Any, kwargs: Any, dim: int) -> int:
    """Size along ``dim`` of the first input tensor that has that dimension."""
    for t in tree_flatten((args, kwargs))[0]:
        if isinstance(t, torch.Tensor) and t.dim() > dim:
            return int(t.shape[dim])
    raise ValueError(
        f"no input tensor has a dimension {dim}, so its size cannot be changed; name the "
        f"dimension that holds the batch (batch_dim=) or the sequence (seq_dim=)"
    )


def with_size(value: Any, dim: int, old: int, new: int) -> Any:
    """``value`` with every tensor of size ``old`` along ``dim`` given size ``new``; a tensor
    that appears twice is resized once and appears twice."""
    if new == old:
        return value
    made: dict[int, torch.Tensor] = {}  # a tensor passed twice (ids as labels) stays one

    def resize(t: Any) -> Any:
        if not (isinstance(t, torch.Tensor) and t.dim() > dim and t.shape[dim] == old):
            return t
        if id(t) not in made:
            if t.is_meta:
                shape = list(t.shape)
                shape[dim] = new
                made[id(t)] = t.new_empty(shape).requires_grad_(t.requires_grad)
            else:
                index = torch.arange(new, device=t.device) % old
                made[id(t)] = t.index_select(dim, index).requires_grad_(t.requires_grad)
        return made[id(t)]

    return tree_map(resize, value)
