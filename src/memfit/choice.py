"""``Choice``: a closed set of values that are also their strings, for every enum of the API.

``memfit.Executor.INDUCTOR == "inductor"``, so a user may write either and code may compare with
either; a misspelt string fails where it is converted (``Executor("inductr")``), naming the
choices. ``enum.StrEnum`` does this from Python 3.11; memfit supports 3.10, so this is its
equivalent there.
"""

from __future__ import annotations

import enum

__all__ = ["Choice"]


class Choice(str, enum.Enum):
    """A closed choice whose members are their strings (``str(member) == member.value``)."""

    def __str__(self) -> str:
        return str(self.value)
