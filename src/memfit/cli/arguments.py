"""Command-line values turned into what memfit needs, each rejected in one line when wrong.

argparse's own ``type=`` converters print a usage block before their message; the checks here
instead raise :class:`~memfit.cli.errors.CliError` after parsing, so every bad value reads the same
way: ``memfit: error: <value>: <rule>; <what to do>`` and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import torch

from memfit.cli.errors import CliError
from memfit.planning.budget import parse_budget
from memfit.planning.policy import NAMED, Policy, parse_policy

__all__ = [
    "Command",
    "HelpFormatter",
    "parse_batch_budget",
    "parse_device",
    "parse_dtype",
    "parse_policies",
    "parse_shape",
    "DTYPES",
]


class HelpFormatter(argparse.HelpFormatter):
    """Descriptions wrapped to the terminal; an epilog of examples printed as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("examples:"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


@dataclass(frozen=True)
class Command:
    """A ``memfit`` subcommand's name and texts, declared once beside its examples; every
    subcommand's parser is made from one, so all their help reads alike."""

    #: What the user types after ``memfit``.
    name: str
    #: One line in ``memfit --help``'s list of commands.
    help: str
    #: The paragraph ``memfit NAME --help`` opens with, wrapped to the terminal.
    description: str
    #: Printed as written after the flags; starts with ``examples:``.
    examples: str

    def add_to(self, sub: Any, parents: list[argparse.ArgumentParser]) -> argparse.ArgumentParser:
        """This command's parser in ``sub`` (an ``add_subparsers`` result), with the flags
        every command shares (``parents``)."""
        parser: argparse.ArgumentParser = sub.add_parser(
            self.name,
            parents=parents,
            help=self.help,
            description=self.description,
            epilog=self.examples,
            formatter_class=HelpFormatter,
        )
        return parser


#: ``--dtype`` names and the torch dtypes they mean.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float64": torch.float64,
    "fp64": torch.float64,
    "double": torch.float64,
}


def parse_device(text: str | None) -> torch.device:
    """``--device``: ``cpu``, ``cuda`` or ``cuda:N`` that exists here; default CUDA if present."""
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise CliError(f"--device {text!r} is not a device name; use cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise CliError(
            f"--device {text!r}: memfit measures only CPU and CUDA memory; use cpu, cuda or cuda:N"
        )
    if not torch.cuda.is_available():
        raise CliError(
            f"--device {text!r} does not exist: this torch ({torch.__version__}) sees "
            "no CUDA device; use --device cpu"
        )
    count = torch.cuda.device_count()
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if not 0 <= index < count:
        raise CliError(
            f"--device {text!r} does not exist: this machine has {count} CUDA "
            f"device(s), cuda:0 to cuda:{count - 1}"
        )
    return torch.device("cuda", index)


def parse_dtype(text: str | None) -> torch.dtype | None:
    """``--dtype``: a floating-point dtype for parameters and floating inputs, or None (keep)."""
    if text is None:
        return None
    try:
        return DTYPES[text.lower()]
    except KeyError:
        raise CliError(
            f"--dtype {text!r} is not a floating-point dtype memfit knows; use one of "
            "float32, bfloat16, float16, float64"
        ) from None


def parse_batch_budget(text: str) -> int:
    """``--budget`` of ``memfit profile``: bytes of device memory for a whole training step.

    Accepted as bytes (``2147483648``) or a size with a unit (``1.5GiB``, ``800MB``, ``512KiB``).
    A fraction is refused: the max-batch search needs an absolute amount of memory.
    """
    try:
        budget = parse_budget(text)
    except (TypeError, ValueError) as err:
        raise CliError(f"--budget {text!r}: {err}") from None
    if budget.bytes is None:
        raise CliError(
            f"--budget {text!r} is a fraction, but the largest-batch search needs an "
            "amount of memory: give bytes or a size such as '1.5GiB', '800MB', '512KiB'"
        )
    return budget.bytes


def parse_policies(text: str, *, offload: bool = False, autotune: bool = False) -> list[Policy]:
    """``--policies``: comma-separated policies as ``memfit.parse_policy`` reads them.

    ``none`` (plain autograd, nothing recomputed) is always run first: every ratio is taken to it.
    With ``offload`` (``--offload``), ``"memory"`` and every budget also run with offload, and
    ``"swap"`` is added, so each offload row sits beside its recompute-only twin. With
    ``autotune`` (``--autotune``), every budget is timed against ``"speed"``'s plan
    (``memfit.checkpoint``'s ``autotune``); there must be one.
    """
    policies: list[Policy] = [Policy("none")]
    for raw in filter(None, (part.strip() for part in text.split(","))):
        try:
            policy = parse_policy(raw)
        except (TypeError, ValueError) as err:
            raise CliError(f"--policies {raw!r}: {err}") from None
        if autotune and policy.budget is not None:
            policy = dataclasses.replace(policy, autotune=True)
        if policy not in policies:
            policies.append(policy)
    if offload:
        for policy in list(policies):
            if policy.chooses_what_to_keep and not policy.offload:
                twin = dataclasses.replace(policy, offload=True)
                if twin not in policies:
                    policies.append(twin)
        if Policy("swap") not in policies:
            policies.append(Policy("swap"))
    if autotune and not any(p.autotune for p in policies):
        raise CliError(f"--autotune times budgets' plans: --policies {text!r} names no budget")
    return policies


#: The policies ``--policies`` names in its help.
POLICY_NAMES = ", ".join(NAMED)


_SHAPE_SPLIT = re.compile(r"[,\s]+|(?<=\d)x(?=\d)")


def parse_shape(text: str) -> tuple[int, ...]:
    """``--input-shape 8,3,32,32`` (or ``8x3x32x32``): positive sizes."""
    parts = [p for p in _SHAPE_SPLIT.split(text.strip()) if p]
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if not shape or any(s <= 0 for s in shape):
        raise CliError(
            f"--input-shape {text!r} is not a shape; write positive sizes separated "
            "by commas, e.g. --input-shape 8,3,32,32"
        )
    return shape
