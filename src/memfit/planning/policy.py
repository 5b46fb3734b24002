"""Policies: what a user asks memfit to optimise, in the one vocabulary of the API, planner and CLI.

A policy is one of the named objectives below, the ``"collection"`` of values a user marked
(``memfit.mark``, or the outputs of listed submodules), or a byte budget within which memfit finds
the cheapest plan. Every policy is answered the same way: a ``Decision`` per forward value
(``planning.decision``), planned on one model of memory and cost. The API
(``memfit.checkpoint(model, policy)``), the planner and the command line (``--policies``) all
parse and print policies through this module, so a policy has one name everywhere.

Written by a user: a name, a list of submodule names, or a budget as ``parse_budget`` reads it
(``0.5``, ``2**30``, ``"2GiB"``). Parsed, a ``Policy`` is plain data: the objective, the budget,
whether it may offload. Code below the API asks it questions (``budget``, ``least_memory``,
``never_worse_than_none``); only the planner's one dispatch reads ``name``.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass

from memfit.planning.budget import Budget, parse_budget
from memfit.units import format_bytes

__all__ = ["BUDGET", "NAMED", "Policy", "parse_policy"]

#: The named policies and what each keeps for backward (everything else is recomputed).
NAMED: dict[str, str] = {
    "memory": "the least activation memory, each forward op recomputed at most once",
    "speed": "outputs of matmul, convolution and attention, and small tensors",
    "collection": "the tensors marked with memfit.mark, or the outputs of listed submodules",
    "none": "everything the backward reads (plain autograd): the baseline",
    "swap": "everything, recomputing nothing; offloads what can hide behind compute (Meng 2017)",
}

#: The name of a budget policy (its label is ``budget 50%``, ``budget 2.00 GiB``).
BUDGET = "budget"

#: Named policies that must never peak above plain autograd: the planner falls back to it.
_NEVER_WORSE_THAN_NONE = ("memory", "speed", "swap")

#: Policies that may offload.
_OFFLOADING = ("memory", BUDGET, "swap")


@dataclass(frozen=True)
class Policy:
    """One policy: a name from ``NAMED``, or ``"budget"`` with its ``budget``.

    ``modules`` (``"collection"`` only) are submodule names whose outputs are kept, as in
    ``named_modules()``; the wrapper turns them into marks while it captures.
    """

    name: str
    budget: Budget | None = None
    modules: tuple[str, ...] = ()
    #: whether the plan may offload saved values (``"swap"`` always does; ``"memory"`` and a
    #: budget with ``offload=True``)
    offload: bool = False
    #: a budget only, under ``executor="inductor"``: whether the budget's plan is timed against
    #: ``"speed"``'s once both are compiled, and the faster kept (``execution.inductor_fit``'s
    #: ``_faster``); one more compile and some 60 steps on the first call
    autotune: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.autotune, bool):
            raise TypeError(f"autotune is True or False, got {self.autotune!r}")
        if self.name == BUDGET:
            if self.budget is None:
                raise ValueError("the budget policy needs a budget, e.g. 0.5 or 2GiB")
        elif self.name not in NAMED:
            raise ValueError(f"{self.name!r} is not a policy; {_accepted()}")
        elif self.budget is not None:
            raise ValueError(f"policy {self.name!r} takes no budget; use policy 'budget'")
        if self.modules and self.name != "collection":
            raise ValueError(f"submodule names go with the 'collection' policy, not {self.name!r}")
        if self.name == "swap" and not self.offload:
            object.__setattr__(self, "offload", True)
        if self.autotune and self.name != BUDGET:
            raise ValueError(
                f"Options(autotune=True) times a budget's plan against 'speed''s: give a budget, "
                f"not policy {self.name!r}, whose plan is fixed"
            )
        if self.offload and self.name not in _OFFLOADING:
            raise ValueError(
                f"offload=True goes with a budget, 'memory' or 'swap', not {self.name!r}: "
                f"the other policies fix what is kept"
            )

    @property
    def label(self) -> str:
        """How tables, plans and figures name this policy (``memory``, ``budget 50%``)."""
        suffix = " + offload" if self.offload and self.name != "swap" else ""
        suffix += " + autotune" if self.autotune else ""
        if self.budget is None:
            return self.name + suffix
        if self.budget.fraction is not None:
            return f"budget {self.budget.fraction:.0%}{suffix}"
        return f"budget {format_bytes(self.budget.bytes or 0)}{suffix}"

    @property
    def never_worse_than_none(self) -> bool:
        """Automatic named policies fall back to plain autograd where they would peak above it."""
        return self.name in _NEVER_WORSE_THAN_NONE

    @property
    def least_memory(self) -> bool:
        """Whether the objective is the least activation memory (``"memory"``): a plan that
        saves less than another is better whatever it recomputes."""
        return self.name == "memory"

    @property
    def swaps(self) -> bool:
        """Whether the objective is to recompute nothing and offload what hides (``"swap"``)."""
        return self.name == "swap"

    @property
    def chooses_what_to_keep(self) -> bool:
        """Whether memfit chooses what is kept from its cost model (``"memory"``, a budget), so
        it may also choose submodules to recompute whole around graph breaks."""
        return self.name == "memory" or self.budget is not None

    @property
    def written(self) -> str | int | float | list[str]:
        """The policy as a user writes it to ``memfit.checkpoint``."""
        if self.budget is not None:
            fraction = self.budget.fraction
            return fraction if fraction is not None else (self.budget.bytes or 0)
        if self.modules:
            return list(self.modules)
        return self.name

    def call(self, model: str = "model", executor: str = "eager") -> str:
        """The Python call that wraps ``model`` with this policy, run by ``executor`` (the plan
        measured under one executor is not the other's: the call names it)."""
        extra = ", offload=True" if self.offload and not self.swaps else ""
        if executor == "inductor" or self.autotune:
            extra += ", executor='inductor'"
        if self.autotune:
            extra += ", options=memfit.Options(autotune=True)"
        return f"memfit.checkpoint({model}, {self.written!r}{extra})"

    def __str__(self) -> str:
        return self.label


def _accepted() -> str:
    names = ", ".join(map(repr, NAMED))
    return (
        f"accepted: {names}, a budget (bytes such as 2**30 or '2GiB', or a fraction such as 0.5 "
        f"of the activations plain autograd keeps), or a list of submodule names"
    )


def parse_policy(value: Policy | str | int | float | Budget | Sequence[str]) -> Policy:
    """A policy from what a user wrote: a ``Policy``, a name, a budget (``int`` bytes, a size
    string such as ``"2GiB"``, a ``float`` fraction or its text ``"0.5"``), or submodule names.

    Raises ``ValueError`` for an unknown name or an unreadable budget (naming the closest policy
    and every accepted form) and ``TypeError`` for a value of the wrong type.
    """
    if isinstance(value, Policy):
        return value
    if isinstance(value, bool):
        raise TypeError(f"a policy is a name, a budget or a list of submodule names, got {value!r}")
    if isinstance(value, (int, float, Budget)):
        return Policy(BUDGET, budget=parse_budget(value))
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in NAMED:
            return Policy(text.lower())
        if text[:1].isdigit() or text[:1] == ".":
            return Policy(BUDGET, budget=parse_budget(text))
        if text.lower().replace(" ", "").startswith(BUDGET + "="):
            given = text.partition("=")[2].strip()
            raise ValueError(
                f"{value!r}: give the budget itself as the policy, e.g. {given!r} "
                f"(the 'budget=B' form was removed in memfit 0.2)"
            )
        close = difflib.get_close_matches(text.lower(), list(NAMED), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"{value!r} is not a policy{hint}; {_accepted()}")
    if isinstance(value, (list, tuple)):
        for name in value:
            if not isinstance(name, str):
                raise TypeError(
                    f"a policy list holds submodule names (str), got {name!r} of type "
                    f"{type(name).__name__}"
                )
        return Policy("collection", modules=tuple(value))
    raise TypeError(
        f"a policy is a name such as 'memory', a budget (0.5, '2GiB', 2**30) or a list of "
        f"submodule names, got {type(value).__name__}"
    )
