"""Logging inside a captured forward without a graph break: Dynamo's logging config."""

from __future__ import annotations

import logging as _logging
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch._dynamo.config as _dynamo_config

from memfit._compat.dynamo import _LIMIT_ENTRY, _UNSET, _changed

__all__ = [
    "logging_functions",
    "traced_logging",
]

# ---- logging inside a captured forward: Dynamo's logging config (checked 2.13.0) -----------------
# NOTE [logging without graph breaks]
# Dynamo cannot trace a logging call, so each one inside a forward breaks the graph: HF GPT-2's
# loss calls ``logger.warning_once`` every step (first step 9.0 s instead of 6.0 s). Dynamo has
# two documented knobs for this (``torch/_dynamo/config.py``, checked 2.13.0):
# - ``reorderable_logging_functions`` (public as ``torch.compiler.config``'s): a plain or builtin
#   function in the set is not traced but called again after the graph, with the same arguments,
#   so the user still sees it. Only arguments that are tensors, constants or string formats can
#   be replayed; any other (a warning category: ``warnings.warn(msg, FutureWarning)``) still
#   breaks the graph, as without the knob. And only a call in the frame Dynamo compiles is
#   replayed (the forward ``memfit.checkpoint`` compiles, the function ``memfit.step`` compiles):
#   one in a function Dynamo inlines into it (a submodule's forward, a helper) is dropped, because
#   each inlined frame records its calls in its own ``debug_locals``, which nothing replays
#   (``InliningInstructionTranslator``; ``output_graph.py``: "TODO get debug_locals working for
#   nested graph breaks"). Used for ``warnings.warn`` and the ``logging`` module's functions
#   (``logging.warning(...)``), as ``torch.export`` does by default.
# - ``ignore_logging_functions`` (``ignore_logger_methods`` before): a no-op instead. It is the only
#   knob a ``logging.Logger`` method obeys (``LoggingLoggerVariable.call_method`` reads no other),
#   so ``logger.warning(...)`` in a compiled forward is not emitted: the price of one graph. Used
#   for ``logging.Logger``'s methods up to warnings (``debug``, ``info``, ``warning``, ``warn``:
#   an error, ``exception`` or ``critical`` message is never silenced, it breaks the graph as
#   before, and ``log`` may be any of them) and the ones ``transformers.utils.logging`` (and
#   ``diffusers``'s copy of it) adds to ``logging.Logger`` when imported (``warning_once``,
#   ``info_once``: ``functools.lru_cache`` wrappers, matched as a bound method's ``__func__``;
#   ``warning_advice``). Those are read off ``logging.Logger`` at each call, so nothing imports
#   transformers, and a later import is covered from the next call on.
# memfit adds these for its own compiles only (``traced_logging``, around each call): a user's
# other ``torch.compile`` calls keep their config. Neither set is part of any compile cache key.

#: The ``logging`` module's functions replayed after the graph. ``logging.exception`` is not one:
#: replayed after the graph it is outside its ``except`` block and logs no traceback.
_REORDERED_LOGGING: frozenset[Callable[..., Any]] = frozenset(
    {
        warnings.warn,
        _logging.debug,
        _logging.info,
        _logging.warning,
        _logging.error,
        _logging.critical,
        _logging.log,
    }
)
#: Methods of ``logging.Logger`` skipped in a compiled forward: messages up to warnings only.
_LOGGER_METHODS = ("debug", "info", "warning", "warn")
#: The ones ``transformers.utils.logging`` sets on ``logging.Logger`` (read at each call).
_ADDED_LOGGER_METHODS = ("warning_once", "info_once", "warning_advice")
_LOGGER_FUNCTIONS = frozenset(
    f for n in _LOGGER_METHODS if (f := getattr(_logging.Logger, n, None)) is not None
)
_ignored_cache: tuple[tuple[Any, ...], frozenset[Callable[..., Any]]] = ((), _LOGGER_FUNCTIONS)
_REORDER_NAME = "reorderable_logging_functions"
_IGNORE_NAME = "ignore_logging_functions"
#: The two entries' ``_ConfigEntry`` (checked 2.13.0), set through their ``ContextVar`` as for
#: ``_LIMIT_ENTRY`` (None where that is: a torch laid out otherwise).
_LOGGING_ENTRIES: Any = tuple(
    getattr(_dynamo_config, "_config", {}).get(name) for name in (_REORDER_NAME, _IGNORE_NAME)
)
if _LIMIT_ENTRY is None or not all(
    e is not None and hasattr(e, "user_override") and isinstance(e.default, set)
    for e in _LOGGING_ENTRIES
):
    _LOGGING_ENTRIES = None


def logging_functions() -> tuple[frozenset[Callable[..., Any]], frozenset[Callable[..., Any]]]:
    """(replayed after the graph, ignored): the callables ``traced_logging`` adds to Dynamo's
    ``reorderable_logging_functions`` and ``ignore_logging_functions`` (checked 2.13.0)."""
    global _ignored_cache
    methods = _logging.Logger.__dict__
    added = tuple(methods.get(n) for n in _ADDED_LOGGER_METHODS)
    if added != _ignored_cache[0]:
        ignored = _LOGGER_FUNCTIONS | {f for f in added if f is not None}
        _ignored_cache = (added, ignored)
    return _REORDERED_LOGGING, _ignored_cache[1]


def traced_logging() -> AbstractContextManager[Any]:
    """Dynamo traces through logging and ``warnings.warn`` calls while the context is open,
    without a graph break (NOTE [logging without graph breaks]); the config is restored on exit.

    Every training step opens one, so, like ``accumulated_recompile_limit``, it sets the config
    entries' ``ContextVar`` and resets it with the token: 5-7 us, where
    ``torch._dynamo.config.patch`` took 22 (a loaded 2-core CPU, 2026-11-28). Functions the
    user's config already lists stay as they are (a user's own ``ignore_logging_functions`` entry
    is not turned into a replay).
    """
    return _TracedLogging()


class _TracedLogging:
    """``traced_logging``: each set extended with memfit's entries, on the user's current one."""

    __slots__ = ("tokens", "patch")

    def __init__(self) -> None:
        self.tokens: list[tuple[Any, Any, str]] = []
        self.patch: Any = None

    def __enter__(self) -> None:
        if self.tokens or self.patch is not None:
            raise RuntimeError("traced_logging is not reentrant: open a new one")
        reordered, ignored = logging_functions()
        entries = _LOGGING_ENTRIES
        if entries is None:  # a torch laid out otherwise: read the attributes, patch them
            user_reordered = getattr(_dynamo_config, _REORDER_NAME)
            user_ignored = getattr(_dynamo_config, _IGNORE_NAME)
        else:
            user_reordered = _config_value_now(entries[0])
            user_ignored = _config_value_now(entries[1])
        wanted = (
            (0, _REORDER_NAME, reordered - user_ignored, user_reordered),
            (1, _IGNORE_NAME, ignored - user_reordered, user_ignored),
        )
        patch = {name: current | ours for _, name, ours, current in wanted if not ours <= current}
        if entries is None:
            self.patch = _dynamo_config.patch(patch)
            self.patch.__enter__()
            return
        for i, name, _, _ in wanted:
            if name in patch:
                self.tokens.append((entries[i], entries[i].user_override.set(patch[name]), name))
        if self.tokens:
            _changed(*patch)

    def __exit__(self, *exc: object) -> None:
        if self.patch is not None:
            self.patch.__exit__(*exc)
            self.patch = None
        if self.tokens:
            for entry, token, _ in reversed(self.tokens):
                entry.user_override.reset(token)
            _changed(*(name for _, _, name in self.tokens))
            self.tokens.clear()


def _config_value_now(entry: Any) -> Any:
    """A config entry's value as the config module's ``__getattr__`` reads it, without copying
    a mutable default into the entry as that does (checked 2.13.0)."""
    for value in (entry.env_value_force, entry.user_override.get(), entry.env_value_default):
        if value is not _UNSET:
            return value
    return entry.default
