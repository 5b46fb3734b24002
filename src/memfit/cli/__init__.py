"""``memfit``: the command line: ``demo``, ``profile TARGET``, ``fit TARGET``, ``pipeline TARGET``,
``bench``.

One module per command (``demo``, ``profile``, ``fit``, ``pipeline``, ``bench``), each with
``add_parser`` and ``run``; the measuring they share is in ``steps`` (a training step per
policy), ``activations`` (saved tensors by submodule), ``batch_search`` (largest batch within a
budget), ``figures``, ``tables`` and ``report`` (the JSON report and its schema). Input checks
raise ``errors.CliError``, which :func:`main` prints as one line ``memfit: error: ...`` with exit
status 2; ``--debug`` adds the traceback. argparse (standard library) parses, rich prints tables
and progress, matplotlib draws.

OpenMP's wait policy: the commands time training steps, and with OpenMP's default (active)
waiting, threads spin at every barrier; when another process holds one of the cores, a 2-thread
CPU step measured 10-30x slower (3 s instead of 120 ms for the demo's ResNet). OpenMP reads
``OMP_WAIT_POLICY`` once, when torch loads, which happens before any of this code runs (importing
``memfit`` imports torch). So the ``memfit`` script (:func:`console_main`) starts itself again
with ``OMP_WAIT_POLICY=PASSIVE`` when the environment does not set it; set it yourself
(``OMP_WAIT_POLICY=ACTIVE memfit ...``) to choose. :func:`main` itself never restarts anything.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence

from rich.console import Console

import memfit
from memfit.cli import bench, demo, fit, pipeline, profile
from memfit.cli.arguments import HelpFormatter
from memfit.cli.errors import EXIT_USAGE, CliError, first_line

__all__ = ["main", "console_main", "build_parser", "CliError"]

_COMMANDS = ("demo", "profile", "fit", "pipeline", "bench")

EXAMPLES = """\
examples:
  memfit demo                                   # what memfit does, on a ResNet, in ~20 s
  memfit profile model.py:make --budget 2GiB    # your model: memory by layer, largest batch
  memfit fit config.json --device h100-80gb --batch 8 --seq 4096   # will it fit on an H100
  memfit pipeline model.py:make --ranks 4 --microbatches 8   # cut into pipeline stages
  memfit bench depth-sweep --quick              # the depth benchmark, small

Run `memfit COMMAND --help` for each command's options and examples.
"""


def build_parser() -> argparse.ArgumentParser:
    # In subcommands --debug has no default, so `memfit --debug profile ...` is not overwritten.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help="on an error, print the full traceback",
    )
    parser = argparse.ArgumentParser(
        prog="memfit",
        epilog=EXAMPLES,
        formatter_class=HelpFormatter,
        description="Train PyTorch models and batches that do not fit in memory: measure what "
        "memfit's checkpointing saves on a demo model or on yours.",
    )
    parser.add_argument(
        "--debug", action="store_true", help="on an error, print the full traceback"
    )
    parser.add_argument("--version", action="version", version=f"memfit {memfit.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    demo.add_parser(sub, [common])
    profile.add_parser(sub, [common])
    fit.add_parser(sub, [common])
    pipeline.add_parser(sub, [common])
    bench.add_parser(sub, [common])
    return parser


def _console() -> Console:
    # A pipe or a test's capture reports 80 columns, too narrow for the tables.
    return Console(width=None if sys.stdout.isatty() else 120)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 failure, 2 bad input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # --help, --version, or argparse's own usage errors
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    debug = getattr(args, "debug", False)
    # Kineto (torch's profiler library) prints a "USDT ... profiler_start/stop" line at every
    # profiler session; the commands measure memory with one session per step, so those lines
    # buried the tables. It reads the level when the first session starts; a user's own setting
    # wins. Only the command line sets it: a library must not change a user's process.
    if not os.environ.get("KINETO_LOG_LEVEL"):
        os.environ["KINETO_LOG_LEVEL"] = "6"
    try:
        return int(args.run(args, _console()))
    except CliError as err:
        if debug:
            traceback.print_exc()
        print(f"memfit: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("memfit: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - reported in one line; --debug shows the rest
        if debug:
            traceback.print_exc()
        print(
            f"memfit: error: {first_line(err)} (run again with --debug for the traceback)",
            file=sys.stderr,
        )
        return 1


def console_main() -> int:
    """The ``memfit`` script: :func:`main`, under ``OMP_WAIT_POLICY=PASSIVE`` unless set (above)."""
    argv = sys.argv[1:]
    asks_help = any(a in ("-h", "--help", "--version") for a in argv)
    if "OMP_WAIT_POLICY" not in os.environ and argv[:1] and argv[0] in _COMMANDS and not asks_help:
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", "memfit", *argv], env)
    return main(argv)
