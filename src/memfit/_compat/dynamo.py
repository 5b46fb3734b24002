"""Dynamo's counters (graph breaks, frames converted, graphs), its recompile limit, and where
numpy's random functions draw."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

__all__ = [
    "accumulated_recompile_limit",
    "compile_with_recompile_limit",
    "frames_converted",
    "graph_break_reasons",
    "numpy_random_in_python",
    "unique_graph_count",
]


# ---- Dynamo's counters: torch._dynamo.utils.counters (checked 2.13.0) ----------------------------
def graph_break_reasons() -> dict[str, int]:
    """How often Dynamo recorded each graph-break reason so far in this process.

    Dynamo counts them under two keys of ``torch._dynamo.utils.counters`` (checked 2.13.0):
    ``graph_break`` (an untraceable call, such as ``print``) and ``unimplemented`` (data-dependent
    control flow, such as an ``if`` on a tensor's value).
    """
    from torch._dynamo.utils import counters

    out: dict[str, int] = {}
    for key in ("graph_break", "unimplemented"):
        for reason, count in counters.get(key, {}).items():
            out[reason] = out.get(reason, 0) + count
    return out


def frames_converted() -> tuple[object, int]:
    """A token that changes whenever Dynamo has tried to convert a frame since it was taken.

    Dynamo records graph-break reasons only while it converts a frame, and counts every frame it
    tries to convert under ``counters["frames"]["total"]`` (``ConvertFrame.__call__``, checked
    2.13.0): while that count stands, no reason was added. The token holds the counter object
    too, so clearing the counters (``counters.clear()``, as Dynamo's own test cases do; a
    ``torch._dynamo.reset`` keeps them) never reads as "unchanged".
    Reading it is two dictionary lookups, where ``graph_break_reasons`` walks every reason.
    """
    global _COUNTERS
    if _COUNTERS is None:  # imported once: an import statement costs a microsecond a call
        from torch._dynamo.utils import counters

        _COUNTERS = counters
    frames = _COUNTERS["frames"]
    return frames, frames["total"]


_COUNTERS: Any = None  # torch._dynamo.utils.counters, once frames_converted first reads it


def unique_graph_count() -> int:
    """Graphs Dynamo has compiled in this process: a change means something was recompiled."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_with_recompile_limit(
    fn: Callable[..., Any],
    *,
    backend: Any,
    dynamic: bool | None,
    limit: int,
    fullgraph: bool = False,
) -> Callable[..., Any]:
    """``torch.compile(fn, backend=..., dynamic=..., fullgraph=..., recompile_limit=limit)``.

    ``recompile_limit`` (documented in ``torch.compile``'s docstring, checked 2.13.0) lifts
    Dynamo's per-code-object limit (``torch._dynamo.config.recompile_limit``, 8) for the frames
    this compile converts only; ``torch.compile``'s typed overloads do not list it yet, hence the
    call through ``Any``.
    """
    compile_: Any = torch.compile
    return compile_(
        fn, backend=backend, dynamic=dynamic, fullgraph=fullgraph, recompile_limit=limit
    )


def accumulated_recompile_limit(limit: int) -> AbstractContextManager[Any]:
    """Dynamo's process-wide cap on compiled variants of one code object
    (``torch._dynamo.config.accumulated_recompile_limit``, 256) raised to at least ``limit`` while
    the context is open, and restored on exit (``_RaisedRecompileLimit``).

    Every ``torch.compile``d module enters through one shared code object
    (``torch/_dynamo/external_utils.py``'s ``inner``), and this cap counts its variants across
    every ``torch.compile`` call in the process: after 256 memfit wrappers' captures, new ones ran
    eagerly without a plan (measured: 44 of 300 one-capture wrappers). The per-code limit (8)
    is lifted for memfit's calls by ``torch.compile(recompile_limit=...)`` instead, which applies
    to those calls only; this cap has no such parameter (checked 2.13.0). memfit counts shapes
    per wrapper itself and opens this around its own calls only. Those run eagerly, excluded from
    any outer ``torch.compile`` (``PlannedCall.__call__``), so this is never traced.
    """
    return _RaisedRecompileLimit(limit)


import torch._dynamo.config as _dynamo_config  # noqa: E402
import torch.utils._config_module as _config_module  # noqa: E402

#: Where Dynamo's config module keeps ``accumulated_recompile_limit``'s value (checked 2.13.0):
#: an entry whose ``user_override`` is a ``ContextVar``, which ``__setattr__`` sets before marking
#: the module's cached dicts dirty. None on a torch laid out otherwise (then plain attributes).
_LIMIT_NAME = "accumulated_recompile_limit"
_LIMIT_ENTRY: Any = getattr(_dynamo_config, "_config", {}).get(_LIMIT_NAME)
_UNSET: Any = getattr(_config_module, "_UNSET_SENTINEL", None)
if _UNSET is None or not all(
    hasattr(x, attr)
    for x, attr in (
        (_LIMIT_ENTRY, "user_override"),
        (_LIMIT_ENTRY, "env_value_force"),
        (_LIMIT_ENTRY, "env_value_default"),
        (_LIMIT_ENTRY, "default"),
        (_dynamo_config, "_hash_dirty_var"),
        (_dynamo_config, "_mark_get_dict_dirty"),
    )
):
    _LIMIT_ENTRY = None


def _recompile_limit_now() -> int:
    """``accumulated_recompile_limit`` as the config module's ``__getattr__`` reads it (an
    environment's forced value, the user's, the environment's default, the default: checked
    2.13.0), without its deprecation and alias checks: every training step reads it."""
    entry = _LIMIT_ENTRY
    for value in (entry.env_value_force, entry.user_override.get(), entry.env_value_default):
        if value is not _UNSET:
            return int(value)
    return int(entry.default)


class _RaisedRecompileLimit:
    """Dynamo's ``accumulated_recompile_limit`` raised to at least ``limit`` while the context is
    open, and restored on exit.

    Every training step opens one, so it is cheap: it sets the config entry's ``ContextVar`` as
    ``__setattr__`` does (and marks the same caches dirty), and on exit resets it with the token,
    which restores the value exactly, unset included. Through the module's ``__setattr__``, read
    and written back, the context took 36-46 us of a step inside real steps (about 8.6 us in a
    tight loop, against 0.7 for the entry's own ``set``/``reset``), the largest part of memfit's
    130 us per step above ``torch.compile``'s on a tiny encoder (CPU, 2026-11-27).
    """

    __slots__ = ("limit", "token", "saved")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.token: Any = None
        self.saved: int | None = None

    def __enter__(self) -> None:
        if self.token is not None or self.saved is not None:
            raise RuntimeError("accumulated_recompile_limit is not reentrant: open a new one")
        if _LIMIT_ENTRY is None:
            current = _dynamo_config.accumulated_recompile_limit
            if current < self.limit:
                self.saved = current
                _dynamo_config.accumulated_recompile_limit = self.limit
            return
        if _recompile_limit_now() >= self.limit:
            return
        self.token = _LIMIT_ENTRY.user_override.set(self.limit)
        _changed()

    def __exit__(self, *exc: object) -> None:
        if self.token is not None:
            _LIMIT_ENTRY.user_override.reset(self.token)
            self.token = None
            _changed()
        elif self.saved is not None:
            _dynamo_config.accumulated_recompile_limit = self.saved
            self.saved = None


def _changed(*names: str) -> None:
    """What Dynamo's config ``__setattr__`` does after setting a value (checked 2.13.0), for the
    entries ``names`` (by default ``accumulated_recompile_limit``)."""
    config: Any = _dynamo_config
    config._hash_dirty_var.set(True)
    for name in names or (_LIMIT_NAME,):
        config._mark_get_dict_dirty(name)


# ---- numpy's random functions under Dynamo: use_numpy_random_stream (checked 2.13.0) -----------
#: ``torch._dynamo.config.use_numpy_random_stream``'s entry, laid out as the recompile limit's
#: (checked 2.13.0); None on a torch laid out otherwise (then plain attributes).
_NUMPY_RANDOM_NAME = "use_numpy_random_stream"
_NUMPY_RANDOM_ENTRY: Any = (
    getattr(_dynamo_config, "_config", {}).get(_NUMPY_RANDOM_NAME) if _LIMIT_ENTRY else None
)


def numpy_random_in_python() -> AbstractContextManager[Any]:
    """While open, Dynamo leaves ``numpy.random`` calls to Python (a graph break at each) instead
    of tracing them as torch random ops (``torch._dynamo.config.use_numpy_random_stream``,
    checked 2.13.0; restored exactly on exit).

    Why: by default Dynamo traces ``np.random.rand``, ``choice``, ... through ``torch._numpy``,
    which draws from torch's generator, not numpy's (torch's documented default: "use numpy's
    PRNG if True, pytorch otherwise"). A model that draws with numpy in its forward
    (wav2vec2's SpecAugment masks) then drew other masks than plain PyTorch, advanced torch's
    stream instead of numpy's, and so shifted every dropout and LayerDrop draw after it. Left to
    Python, the draws are numpy's own, in the order plain PyTorch makes them. Read only while
    Dynamo traces; opened around every memfit call (a context variable set and reset, and the
    config's caches marked: 8.8 us measured on a loaded 2-core machine, 0.45 of it the set and
    reset).
    """
    return _NumpyRandomInPython()


class _NumpyRandomInPython:
    """``numpy_random_in_python``: the config entry's ``ContextVar`` set and reset, as
    ``_RaisedRecompileLimit`` does; a value the user set to True is left alone."""

    __slots__ = ("token", "saved")

    def __init__(self) -> None:
        self.token: Any = None
        self.saved: bool | None = None

    def __enter__(self) -> None:
        entry = _NUMPY_RANDOM_ENTRY
        if entry is None:
            if not _dynamo_config.use_numpy_random_stream:
                self.saved = False
                _dynamo_config.use_numpy_random_stream = True
            return
        if entry.env_value_force is not _UNSET or entry.user_override.get() is True:
            return  # forced by the environment, or already on
        self.token = entry.user_override.set(True)
        _changed(_NUMPY_RANDOM_NAME)

    def __exit__(self, *exc: object) -> None:
        if self.token is not None:
            _NUMPY_RANDOM_ENTRY.user_override.reset(self.token)
            self.token = None
            _changed(_NUMPY_RANDOM_NAME)
        elif self.saved is not None:
            _dynamo_config.use_numpy_random_stream = self.saved
            self.saved = None
