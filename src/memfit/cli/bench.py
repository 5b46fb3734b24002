"""``memfit bench depth-sweep``: the depth benchmark (``memfit.bench.depth_sweep``) from the CLI.

It writes ``depth_sweep.{json,md,png}`` under ``--out`` and nowhere else: the default is
``memfit-bench`` in the temporary directory, never the working tree, and the path is printed at
the end. (The repository's ``benchmarks/depth_sweep.py`` runs the same sweep into
``benchmarks/results`` and rewrites the table in ``benchmarks/README.md``.) Its timings on a
shared CPU need ``OMP_WAIT_POLICY=PASSIVE``, which the ``memfit`` script sets unless the
environment does (see ``memfit.cli``).
"""

from __future__ import annotations

import argparse
from typing import Any

from memfit.bench import depth_sweep
from memfit.cli.arguments import Command, parse_device
from memfit.cli.errors import CliError

__all__ = ["add_parser", "run_depth_sweep"]

EXAMPLES = """\
examples:
  memfit bench depth-sweep                 # 9 to 129 blocks, ~5 min on 2 CPU cores
  memfit bench depth-sweep --quick         # 6, 12, 24 blocks; writes depth_sweep_quick.*
                                           # in memfit-bench in the temporary directory
  memfit bench depth-sweep --device cuda --out results/gpu
"""

COMMAND = Command(
    "bench",
    help="run memfit's benchmarks",
    description="Run one of memfit's benchmarks and write its results.",
    examples=EXAMPLES,
)

DEPTH_SWEEP = Command(
    "depth-sweep",
    help="peak memory and step time vs ResNet depth, against checkpoint_sequential",
    description="Peak memory and step time of one training step of CIFAR ResNets from 9 to "
    "129 residual blocks: plain PyTorch, memfit's policies, checkpoint_sequential. "
    "Writes JSON, Markdown and PNG to --out (default: memfit-bench in the "
    "temporary directory, not the working directory).",
    examples=EXAMPLES,
)


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = COMMAND.add_to(sub, parents)
    benches = p.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    d = DEPTH_SWEEP.add_to(benches, parents)
    depth_sweep.add_arguments(d)
    d.set_defaults(run=run_depth_sweep)
    return p


def run_depth_sweep(args: argparse.Namespace, console: Any) -> int:
    device = parse_device(args.device)
    for flag, values in (
        ("--depths", args.depths or [1]),
        ("--batch", [args.batch]),
        ("--width", [args.width]),
        ("--repeats", [args.repeats]),
    ):
        if min(values) < 1:
            raise CliError(f"{flag} {' '.join(map(str, values))}: must be at least 1")
    depth_sweep.run(args, device)
    return 0
