"""Names torch keeps in private modules that memfit uses as they are: pytrees, AOTAutograd's
backend factory, fake-tensor mode detection, storage identities, dispatch modes.
"""

from __future__ import annotations

__all__ = [
    "OpOverload",
    "StorageWeakRef",
    "TorchDispatchMode",
    "aot_autograd",
    "detect_fake_mode",
    "disable_current_modes",
    "keystr",
    "tree_flatten",
    "tree_flatten_with_path",
    "tree_map",
    "tree_map_only",
    "tree_unflatten",
]

# ---- pytrees: torch.utils._pytree (checked 2.13.0) ----------------------------------------------
# Flattening nested inputs and outputs the way Dynamo does. torch 2.13 has no public pytree module.
# ---- AOTAutograd and FX (checked 2.13.0) ---------------------------------------------------------
# aot_autograd: a Dynamo backend from forward/backward compilers and a partition function; it is
# how every torch.compile backend that wants a joint graph gets one.
from torch._dynamo.backends.common import aot_autograd  # noqa: E402

# detect_fake_mode: the fake-tensor mode of a traced graph's values, to compute the metadata of a
# node memfit inserts (the BatchNorm split).
from torch._guards import detect_fake_mode  # noqa: E402

# OpOverload: the type of an ATen op in an FX graph (``aten.mm.default``).
from torch._ops import OpOverload  # noqa: E402

# StorageWeakRef: a hashable identity of a (fake) storage, to count views of one storage once.
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402

# ---- dispatch modes and fake tensors (checked 2.13.0) --------------------------------------------
# TorchDispatchMode: attributing saved activations to the module that made them. Documented in
# "Extending PyTorch", but it lives in a private module.
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes  # noqa: E402
from torch.utils._pytree import (  # noqa: E402
    keystr,
    tree_flatten,
    tree_flatten_with_path,
    tree_map,
    tree_map_only,
    tree_unflatten,
)
