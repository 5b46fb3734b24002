"""What a benchmark records when one of its points fails, so one failure never ends a sweep.

A sweep over many settings should report every point it could measure; a point that raises (out
of memory, a backend error) is recorded with its phase and traceback in the results file and
announced in one line, and the sweep goes on.
"""

from __future__ import annotations

import traceback
from typing import Any

__all__ = ["record_failure"]


def record_failure(record: dict[str, Any], label: str, phase: str, err: BaseException) -> None:
    """Store ``err`` in ``record`` (error, phase, traceback) and print one line about it."""
    record["error"] = f"{type(err).__name__}: {err}".strip()
    record["error_phase"] = phase
    record["traceback"] = traceback.format_exc()
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    print(f"    ! {label} failed while {phase}: {type(err).__name__}: {first}", flush=True)
