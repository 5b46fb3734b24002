"""nn.Module's own table of children, read as it is.

Part of ``memfit._compat``: see its docstring for the rule these entries follow.
"""

from __future__ import annotations

import torch.nn as nn

__all__ = [
    "child_module",
]


# ---- a module's children (checked 2.13.0) --------------------------------------------------------
def child_module(module: nn.Module, name: str) -> nn.Module | None:
    """The child ``module`` registered under ``name`` (``module._modules``, checked 2.13.0), or
    None where there is none or it was registered as None.

    Neither public reading is the same: ``getattr`` also finds parameters, buffers and plain
    attributes, and ``named_children`` yields a module registered under two names once.
    """
    return module._modules.get(name)
