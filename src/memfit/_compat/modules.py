"""nn.Module's own tables of children, parameters and buffers, read as they are."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

__all__ = [
    "child_module",
    "own_tensor_tables",
]


# ---- a module's children (checked 2.13.0) --------------------------------------------------------
def child_module(module: nn.Module, name: str) -> nn.Module | None:
    """The child ``module`` registered under ``name`` (``module._modules``, checked 2.13.0), or
    None where there is none or it was registered as None.

    Neither public reading is the same: ``getattr`` also finds parameters, buffers and plain
    attributes, and ``named_children`` yields a module registered under two names once.
    """
    return module._modules.get(name)


# ---- a module's own parameters and buffers (checked 2.13.0) --------------------------------------
def own_tensor_tables(module: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """``module``'s own tables of parameters and buffers (``module._parameters``,
    ``module._buffers``, checked 2.13.0), to swap a tensor for another and put it back.

    Why not ``setattr``: it checks a parameter's type and device against nothing memfit needs,
    and ``register_buffer`` would change whether a buffer is persistent; an entry of the table
    replaced and put back leaves the module exactly as it was.
    """
    return module._parameters, module._buffers
