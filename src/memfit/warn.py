"""Warnings that point at the user's line, not at memfit's or torch's internals.

memfit warns from deep inside ``torch.compile`` (a backend, a Dynamo callback, a wrapper's
forward called through ``nn.Module.__call__``); a fixed ``stacklevel`` lands in torch's
``external_utils.py`` or ``module.py``, which tells a user nothing. ``warn_user`` attributes the
warning to the innermost frame outside memfit, torch and the standard library's ``contextlib``
and ``functools``: the line in the user's training loop that made the call.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings
from typing import Any

import torch

__all__ = ["warn_user", "user_frame"]

_INTERNAL = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep
    for m in (sys.modules["memfit"], torch)
    if m.__file__
) + tuple(os.path.abspath(m.__file__) for m in (contextlib, functools) if m.__file__)


def user_frame() -> tuple[str, int, dict[str, object]] | None:
    """(file, line, globals) of the innermost caller outside memfit and torch, if any."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        generated = frame.f_code.co_filename.startswith(("<eval_with_key", "<frozen"))
        if not path.startswith(_INTERNAL) and not generated:
            return frame.f_code.co_filename, frame.f_lineno, frame.f_globals
        frame = frame.f_back  # type: ignore[assignment]
    return None


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message)`` attributed to the user's line (``user_frame``)."""
    found = user_frame()
    if found is None:
        warnings.warn(message, category, stacklevel=2)
        return
    path, line, globals_ = found
    registry: Any = globals_.setdefault("__warningregistry__", {})
    warnings.warn_explicit(
        message, category, path, line, module=str(globals_.get("__name__", "")), registry=registry
    )
