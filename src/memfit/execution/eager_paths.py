"""Model code that runs another algorithm when it sees ``torch.compile``: memfit traces the one
eager PyTorch runs.

memfit captures a model with Dynamo, and inside Dynamo ``torch.compiler.is_compiling()`` is true,
so a model that branches on it runs, under memfit, code plain PyTorch never runs. HuggingFace's
Mamba and FalconMamba mixers do: with ``use_associative_scan`` (their config's default) they scan
with torch's ``associative_scan`` while compiling, and with a loop over the sequence in eager.
The scan keeps every level's partial products: memfit's ``"none"`` on a tiny Mamba peaked at
1.77x plain PyTorch's, and ``"memory"`` above HF's own gradient checkpointing. memfit's plain
PyTorch oracle is the eager loop, so while memfit runs the model the flag is off, and it is put
back after each call: the model as the user holds it is unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.nn as nn

__all__ = ["compile_only_switches", "eager_paths"]

#: Attributes a module reads to take a path only when compiled, set to the value that keeps the
#: eager path.
_EAGER_VALUES: dict[str, object] = {"use_associative_scan": False}


def compile_only_switches(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """The (module, attribute) pairs in ``model`` set to take a compile-only path."""
    return [
        (m, name)
        for m in model.modules()
        for name, eager in _EAGER_VALUES.items()
        if name in m.__dict__ and m.__dict__[name] != eager
    ]


@contextlib.contextmanager
def eager_paths(switches: list[tuple[nn.Module, str]]) -> Iterator[None]:
    """Within, each switch holds its eager value; after, the value it had."""
    if not switches:
        yield
        return
    before = [getattr(m, name) for m, name in switches]
    for m, name in switches:
        setattr(m, name, _EAGER_VALUES[name])
    try:
        yield
    finally:
        for (m, name), value in zip(switches, before):
            setattr(m, name, value)
