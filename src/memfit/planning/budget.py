"""Budgets as users write them, turned into bytes; and the error for a budget nothing can meet.

A budget is what a user knows about their machine ("I have 2 GiB for activations"), so it is
accepted the way people write it: an integer number of bytes, a string with a unit ("1.5GiB",
"800MB", "512KiB"; SI units are powers of 1000, IEC units powers of 1024, as on disk labels and in
``nvidia-smi`` respectively), or a float in (0, 1] meaning that fraction of the activations plain
autograd saves for backward (``"none"``), plus the rest of its step (gradients, working memory),
resolved once the graph is known.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from memfit.units import format_bytes

__all__ = ["Budget", "BudgetError", "parse_budget", "UNITS"]

#: Accepted unit suffixes (case-insensitive) and their size in bytes.
UNITS: dict[str, int] = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}

_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


class BudgetError(ValueError):
    """No plan meets the budget. ``least_bytes`` is the least peak memfit can achieve."""

    def __init__(
        self, message: str, *, budget_bytes: int | None = None, least_bytes: int | None = None
    ) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.least_bytes = least_bytes


@dataclass(frozen=True)
class Budget:
    """A parsed budget: exactly one of ``bytes`` or ``fraction`` is set."""

    bytes: int | None = None
    fraction: float | None = None

    def resolve(self, baseline_peak_bytes: int, baseline_saved_bytes: int) -> int:
        """Bytes this budget allows for a step whose plain-autograd peak is
        ``baseline_peak_bytes``, of which ``baseline_saved_bytes`` are activations saved for
        backward.

        A fraction applies to the activations only: the rest of the step (gradients, the ops'
        working memory, outputs) is needed at any fraction, so ``budget=0.5`` is the plain peak
        less half the activations, reachable whenever a plan can keep half of them.
        """
        if self.bytes is not None:
            return self.bytes
        assert self.fraction is not None
        return baseline_peak_bytes - round((1.0 - self.fraction) * baseline_saved_bytes)

    def __str__(self) -> str:
        if self.fraction is not None:
            return f"{self.fraction:g} of plain autograd's saved activations"
        return format_bytes(self.bytes or 0)


def parse_budget(value: object) -> Budget:
    """Parse ``value`` (int bytes, "1.5GiB"-style string, or fraction in (0, 1]) into a Budget.

    Raises ``ValueError`` (or ``TypeError`` for a wrong type) naming what was wrong and what is
    accepted, since a budget is often typed on a command line.
    """
    if isinstance(value, Budget):
        return value
    if isinstance(value, bool):
        raise TypeError(f"budget must be bytes, a size string or a fraction, got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"budget must be a positive number of bytes, got {value}")
        return Budget(bytes=value)
    if isinstance(value, float):
        if not math.isfinite(value) or not 0.0 < value <= 1.0:
            raise ValueError(
                f"a float budget is a fraction of the activations plain autograd keeps and must be "
                f"in (0, 1], got {value!r}; for bytes pass an int or a string such as '2GiB'"
            )
        return Budget(fraction=value)
    if isinstance(value, str):
        m = _PATTERN.match(value)
        if m is None or m.group(2).lower() not in UNITS | {"": 1}:
            units = ", ".join(sorted(UNITS, key=lambda u: UNITS[u]))
            raise ValueError(
                f"cannot parse budget {value!r}: expected bytes as an integer, a size such as "
                f"'1.5GiB', '800MB' or '512KiB' (units: {units}),"
                f" or a fraction in (0, 1] such as '0.5'"
            )
        number, unit = float(m.group(1)), m.group(2).lower()
        if not unit and number <= 1 and not m.group(1).isdigit():
            return parse_budget(number)  # "0.5" on a command line is a fraction
        if not unit and not number.is_integer():
            raise ValueError(
                f"budget {value!r} has no unit and is neither whole bytes nor a fraction in "
                f"(0, 1]; write e.g. '{value}GiB'"
            )
        size = number * UNITS.get(unit, 1)
        if size < 1:
            raise ValueError(f"budget {value!r} is less than one byte")
        return Budget(bytes=int(size))
    raise TypeError(
        f"budget must be an int (bytes), a string such as '2GiB', or a float fraction in (0, 1]; "
        f"got {type(value).__name__}"
    )
