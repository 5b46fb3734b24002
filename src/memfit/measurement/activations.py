"""Which submodules hold the activation memory: the tensors plain autograd saves, by producer.

What is measured: one eager training step of the unwrapped model (plain PyTorch, i.e. memfit's
``"none"`` baseline). Every tensor autograd saves for backward passes through a
``torch.autograd.graph.saved_tensors_hooks`` pack hook, which records its storage once (a tensor
saved by several ops, or views of one storage, count once, at the storage's full size). Parameters,
buffers and the example inputs are not activations and are left out. Each saved storage is
attributed to the submodule that *produced* it: a ``TorchDispatchMode`` sees every ATen op with the
stack of module names currently running (pushed and popped by forward hooks), and a fresh output
storage (one not aliasing the op's inputs) is credited to the innermost module, so a functional
``F.relu`` inside a block's ``forward`` counts for the block itself ("self" bytes) and a
``Conv2d``'s output for the ``Conv2d``. Tensors made outside the model (the loss) count for
``(loss)``. Finally the autograd graph is walked once to name the backward nodes that read each
saved tensor (``ConvolutionBackward0``, ...).

These are the bytes plain autograd keeps alive from forward to backward. memfit's ``"none"`` plan
keeps what its captured joint graph needs, which is usually the same set; the report shows both.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit._compat import TorchDispatchMode, tree_flatten

__all__ = ["Activations", "ModuleActivations", "SavedTensor", "saved_activations", "LOSS"]

#: Pseudo-module for tensors made outside the model's forward (the loss).
LOSS = "(loss)"


@dataclass(frozen=True)
class SavedTensor:
    """One storage autograd keeps for backward."""

    bytes: int
    shape: tuple[int, ...]
    dtype: str
    module: str  # producer, as in named_modules(); "" is the model itself
    saved_by: tuple[str, ...]  # backward nodes that read it


@dataclass(frozen=True)
class ModuleActivations:
    """Saved bytes a submodule produced: in its own code (``self``) and with its children."""

    module: str
    type: str
    self_bytes: int
    total_bytes: int
    tensors: int  # storages counted in self_bytes


@dataclass(frozen=True)
class Activations:
    total_bytes: int
    modules: tuple[ModuleActivations, ...]  # by self_bytes, largest first
    tensors: tuple[SavedTensor, ...]  # largest first


def _ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse, some subclasses: no plain storage
        return 0


class _Producers(TorchDispatchMode):
    """Credits each fresh output storage of every ATen op to the innermost running module."""

    def __init__(self, stack: list[str], producers: dict[int, str]) -> None:
        super().__init__()
        self.stack = stack
        self.producers = producers

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {_ptr(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                p = _ptr(t)
                if p and p not in inputs:
                    self.producers[p] = self.stack[-1]
        return out


def _readers(root: Any) -> dict[int, list[str]]:
    """Storage pointer -> names of backward nodes that saved a tensor of it."""
    readers: dict[int, list[str]] = defaultdict(list)
    seen: set[Any] = set()
    todo = [root]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo.extend(n for n, _ in getattr(node, "next_functions", ()))
        for attr in dir(node):
            if not attr.startswith("_saved_"):
                continue
            try:
                value = getattr(node, attr)
            except Exception:  # noqa: BLE001 - a freed or undefined saved value
                continue
            for t in tree_flatten(value)[0]:
                if isinstance(t, torch.Tensor):
                    p = _ptr(t)
                    if p and node.name() not in readers[p]:
                        readers[p].append(node.name())
    return readers


def saved_activations(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor],
) -> Activations:
    """Run one eager training step of ``model`` and attribute what autograd saved (see above).

    The step's backward runs too (it frees the saved tensors); gradients are set to ``None``
    before and after.
    """
    stack = [LOSS]
    producers: dict[int, str] = {}
    excluded = {_ptr(t) for t in [*model.parameters(), *model.buffers()]}
    excluded |= {_ptr(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
    saved: dict[int, tuple[torch.Tensor, int, str]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        p = _ptr(t)
        if p and p not in excluded and p not in saved:
            saved[p] = (t, t.untyped_storage().nbytes(), producers.get(p, stack[-1]))
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def enter(name: str) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: Any) -> None:
            stack.append(name)

        return hook

    def leave(_module: nn.Module, _args: Any, _out: Any) -> None:
        stack.pop()

    names = dict(model.named_modules())
    hooks = []
    for name, module in names.items():
        hooks.append(module.register_forward_pre_hook(enter(name)))
        hooks.append(module.register_forward_hook(leave, always_call=True))
    model.zero_grad(set_to_none=True)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack), _Producers(stack, producers):
            loss = loss_fn(model(*args, **kwargs))
    finally:
        for h in hooks:
            h.remove()
    readers = _readers(loss.grad_fn)
    loss.backward()
    model.zero_grad(set_to_none=True)

    tensors = sorted(
        (
            SavedTensor(
                bytes=n,
                shape=tuple(t.shape),
                dtype=str(t.dtype).removeprefix("torch."),
                module=module,
                saved_by=tuple(readers.get(p, ())),
            )
            for p, (t, n, module) in saved.items()
        ),
        key=lambda s: (-s.bytes, s.module),
    )
    saved.clear()  # drop the references to the saved tensors
    modules = _by_module(tensors, names)
    return Activations(sum(s.bytes for s in tensors), tuple(modules), tuple(tensors))


def _by_module(tensors: list[SavedTensor], names: dict[str, nn.Module]) -> list[ModuleActivations]:
    """Each submodule's (and the loss's) saved bytes, its own and with its children's, largest
    own first; submodules that saved nothing are left out."""
    self_bytes: dict[str, int] = defaultdict(int)
    counts: dict[str, int] = defaultdict(int)
    for s in tensors:
        self_bytes[s.module] += s.bytes
        counts[s.module] += 1
    modules = []
    for name in [*names, LOSS]:
        prefix = name + "."
        total = (
            sum(
                n
                for m, n in self_bytes.items()
                if m != LOSS and (not name or m == name or m.startswith(prefix))
            )
            if name != LOSS
            else self_bytes.get(LOSS, 0)
        )
        if total:
            kind = "-" if name == LOSS else type(names[name]).__name__
            modules.append(
                ModuleActivations(name, kind, self_bytes.get(name, 0), total, counts.get(name, 0))
            )
    modules.sort(key=lambda m: (-m.self_bytes, -m.total_bytes, m.module))
    return modules
