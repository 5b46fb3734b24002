"""The one error type of the command line: a mistake the user can fix, reported in one line.

Why a separate type: a command-line user who typed a wrong path or budget needs the value, the rule
and what to do, not a traceback through memfit's internals. Every check in ``memfit.cli`` raises
``CliError``; ``memfit.cli.main`` prints it as ``memfit: error: ...`` on stderr and exits with
status 2 (the status argparse uses for bad usage). With ``--debug`` the traceback is printed too,
including the user's own code when a factory raised (the cause is chained with ``raise ... from``).
"""

from __future__ import annotations

__all__ = ["CliError", "EXIT_USAGE", "first_line"]

#: Exit status for errors in what the user asked for (as argparse uses).
EXIT_USAGE = 2


class CliError(Exception):
    """A problem with the user's input: printed as one line, exit status 2."""


def first_line(err: BaseException) -> str:
    """``Type: message`` of an exception, cut to its first line so the report stays one line."""
    text = str(err).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(err).__name__}: {line}" if line else type(err).__name__
