"""The four custom ops the executor's graphs call: ``memfit::offload``, ``offload_wait``,
``reload_start`` and ``reload_wait`` (see ``execution.offload``).

Part of ``memfit.execution.offload``: see its docstring.
"""

from __future__ import annotations

from typing import Any

import torch

from memfit.execution.offload.store import _handle, store_for

__all__: list[str] = []  # the ops are registered with torch.library on import


# ---- the custom ops --------------------------------------------------------------------------


@torch.library.custom_op("memfit::offload", mutates_args=())
def _offload(x: torch.Tensor, store: int) -> torch.Tensor:
    s = store_for(store)
    return _handle(s, s.offload(x), owns=False)


@torch.library.custom_op("memfit::offload_wait", mutates_args=())
def _offload_wait(x: torch.Tensor, handle: torch.Tensor, store: int) -> torch.Tensor:
    s = store_for(store)
    key = int(handle.item())
    s.wait_out(key)
    s.slots[key].owned = True
    return _handle(s, key, owns=True)


@torch.library.custom_op("memfit::reload_start", mutates_args=())
def _reload_start(handle: torch.Tensor, store: int) -> torch.Tensor:
    store_for(store).reload_start(int(handle.item()))
    return torch.empty((), dtype=torch.int64)


# The fakes read only what fixes their output's layout. The dispatcher hands a fake the op's
# arguments positionally, in the schema's order, even after a keyword call (none of these
# schemas has keyword-only arguments or defaults), so a fake may take them as ``*args``.


@_offload.register_fake
@_offload_wait.register_fake
@_reload_start.register_fake
def _fake_handle(*_: Any) -> torch.Tensor:
    """What offload, offload_wait and reload_start return: an int64 scalar on the CPU."""
    return torch.empty((), dtype=torch.int64, device="cpu")


@torch.library.custom_op("memfit::reload_wait", mutates_args=())
def _reload_wait(
    handle: torch.Tensor,
    token: torch.Tensor,
    store: int,
    size: list[int],
    stride: list[int],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    return store_for(store).reload_wait(int(handle.item()))


@_reload_wait.register_fake
def _reload_wait_fake(*args: Any) -> torch.Tensor:
    """The reloaded tensor, laid out as the offloaded one was (the op's last four arguments)."""
    *_, size, stride, dtype, device = args
    return torch.empty_strided(size, stride, dtype=dtype, device=device)
