"""Whether a profiler session is running anywhere (a measurement must not nest in one)."""

from __future__ import annotations

import torch

__all__ = [
    "profiler_started_anywhere",
]


# ---- added for measurement -----------------------------------------------------------------------
# Refusing to open a profiler session while another thread has one (that crashes); checked 2.13.0.
def profiler_started_anywhere() -> bool:
    """Whether a torch profiler started from Python is active on *any* thread (checked 2.13.0).

    ``torch.autograd.profiler._is_profiler_enabled`` is the process-wide flag every Python-started
    session (``torch.profiler.profile``, the legacy profiler) sets; ``profiler_enabled`` sees only
    this thread. Starting a second session on another thread crashes the process, so memfit looks.
    """
    return bool(getattr(torch.autograd.profiler, "_is_profiler_enabled", False))
