"""``Choice``: a closed set of values that are also their strings, for every enum of the API.

``memfit.Executor.INDUCTOR == "inductor"``, so a user may write either and code may compare with
either; a misspelt string fails where it is converted (``Executor("inductr")``), naming the
choices. ``enum.StrEnum`` does this from Python 3.11; memfit supports 3.10, so this is its
equivalent there.
"""

from __future__ import annotations

import enum
from typing import TypeVar

__all__ = ["Choice"]

C = TypeVar("C", bound="Choice")


class Choice(str, enum.Enum):
    """A closed choice whose members are their strings (``str(member) == member.value``)."""

    def __str__(self) -> str:
        return str(self.value)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        """Every member's string, in order."""
        return tuple(member.value for member in cls)

    @classmethod
    def parse(cls: type[C], value: object, what: str, public: str) -> C:
        """``value`` (a member or its exact string) as a member; else a ``ValueError`` naming
        ``what`` was given, the choices, and the enum under its ``public`` name."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls(value)
            except ValueError:
                pass
        raise ValueError(f"{what} must be one of {cls.values()} (or {public}), got {value!r}")
