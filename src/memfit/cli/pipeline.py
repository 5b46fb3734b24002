"""``memfit pipeline TARGET --ranks K --microbatches M``: the plan, and with ``--run`` the run.

The flags are ``memfit.pipeline.PipelineOptions``' fields (``pipeline_options`` builds the one
object ``plan`` and every rank's ``Pipeline`` take), so each default is written once, there.

Without ``--run`` nothing but the plan is computed (one process): the cuts, each stage's
modules, predicted time per micro-batch and predicted peak, the step time and the bubble.
``--schedule auto`` compares every schedule, stages per rank and micro-batch count
(``--microbatches`` fixes the count) and prints the table of candidates. With
``--run`` K local processes (gloo, one rank each; ``memfit.pipeline.launch``) train
``--steps`` steps with ``memfit.pipeline.Pipeline`` and the report sets the measurement beside
the prediction: the step time (median over the steps after a first one that compiles), each
stage's peak (exact tensor accounting on CPU, the allocator's statistics on CUDA) and the
bubble, ``1 - M x mean stage time / step time``, where a stage's time is its forward and
backward measured alone in its process (no communication). The loss is that of ``memfit
profile``: the model's scalar output or ``loss`` field, else the sum of its outputs.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from typing import Any

import torch

import memfit
from memfit.cli.arguments import Command
from memfit.cli.errors import CliError
from memfit.cli.steps import default_loss
from memfit.cli.target import build_target
from memfit.pipeline import Pipeline, launch, plan
from memfit.pipeline.pipeline_options import AUTO, PipelineOptions
from memfit.pipeline.schedule import SCHEDULES, PipelineSchedule, equal_stages_bubble
from memfit.units import format_bytes

__all__ = ["add_parser", "pipeline_options", "run"]

#: every flag not given is ``PipelineOptions``' default
_DEFAULT = PipelineOptions()

EXAMPLES = """\
examples:
  memfit pipeline model.py:make --ranks 4 --microbatches 8
  memfit pipeline model.py:make --ranks 2 --microbatches 4 --budget 512MiB --schedule 1f1b
  memfit pipeline model.py:make --ranks 2 --microbatches 4 --run --steps 3
  memfit pipeline model.py:make --ranks 4 --schedule auto --budget 2GiB --offload
"""

COMMAND = Command(
    "pipeline",
    help="split a model into pipeline stages; --run trains it in K local processes",
    description="Plan a pipeline of TARGET (a factory returning (model, "
    "example_inputs), the inputs being one mini-batch): where to cut, what each stage "
    "keeps and recomputes, the predicted step time and per-stage peak. --run launches one "
    "process per stage and reports measured against predicted.",
    examples=EXAMPLES,
)


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = COMMAND.add_to(sub, parents)
    p.add_argument("target", metavar="TARGET", help="path/to/file.py:factory or module:factory")
    p.add_argument("--ranks", type=int, help="ranks (K): one process and one device each")
    p.add_argument("--stages", type=int, dest="deprecated_stages", help=argparse.SUPPRESS)
    p.add_argument(
        "--microbatches",
        type=int,
        help="micro-batches per step (M); required unless --schedule auto, which chooses it",
    )
    p.add_argument(
        "--schedule",
        choices=[*SCHEDULES, AUTO],
        help="torch's schedule, or auto: memfit compares them all "
        f"(default {PipelineSchedule(_DEFAULT.schedule).value})",
    )
    p.add_argument(
        "--stages-per-rank",
        type=int,
        help="stages on each rank (V) for interleaved, looped and V schedules (default 2)",
    )
    p.add_argument("--budget", help="bytes per device, e.g. 2GiB (default: none)")
    p.add_argument(
        "--overhead-ms",
        type=float,
        help="ms each forward and backward costs the schedule's runtime beyond the stage, in "
        "the predicted step (about 2 over gloo on a 2-core CPU; "
        f"default {_DEFAULT.overhead * 1e3:g})",
    )
    p.add_argument(
        "--latency-ms",
        type=float,
        help="ms a value takes between ranks, in the predicted step "
        f"(default {_DEFAULT.latency * 1e3:g})",
    )
    p.add_argument(
        "--offload",
        action="store_const",
        const=True,
        help="let memfit offload what micro-batches keep while they wait for their backward",
    )
    p.add_argument(
        "--optimizer-state",
        type=float,
        help="optimizer state per parameter byte in the memory model "
        f"(Adam: 2, default {_DEFAULT.optimizer_state:g})",
    )
    p.add_argument(
        "--run", dest="execute", action="store_true", help="train in K processes and measure"
    )
    p.add_argument("--steps", type=int, default=3, help="measured steps with --run (default 3)")
    p.add_argument(
        "--timeout", type=float, default=120.0, help="seconds before --run gives up (default 120)"
    )
    p.set_defaults(run=run)
    return p


def _inputs(spec: str) -> tuple[Any, tuple[Any, ...]]:
    target = build_target(spec)
    if target.kwargs:
        raise CliError(f"{spec}: a pipeline takes positional inputs; the factory gave keywords")
    return target.model, target.args


def _loss(output: Any, target: Any) -> torch.Tensor:
    return default_loss(output)


def _rank(rank: int, spec: str, ranks: int, options: PipelineOptions, steps: int) -> dict[str, Any]:
    """One rank of ``--run``: build, plan, train; its prediction and measurements."""
    model, inputs = _inputs(spec)
    pipe = Pipeline(model, inputs, _loss, ranks=ranks, options=options)
    pipe.step(*inputs)  # compiles this rank's stage
    times, peaks = [], []
    for _ in range(steps):
        for p in pipe.parameters():
            p.grad = None
        torch.distributed.barrier()
        start = time.perf_counter()
        measured = memfit.measure(lambda: pipe.step(*inputs))
        times.append(time.perf_counter() - start)
        peaks.append(measured.peak_bytes or 0)
    return {
        "plan": pipe.plan,
        "predicted_peak": pipe.predicted_step_peak_bytes,
        "step_seconds": statistics.median(times),
        "peak_bytes": max(peaks),
        "stage_seconds": pipe.time_stage_alone(),
    }


def pipeline_options(args: argparse.Namespace) -> PipelineOptions:
    """The ``PipelineOptions`` the flags ask for: the flags given, ``PipelineOptions``'
    defaults for the others (so a default is written once, there)."""
    given = {
        "microbatches": args.microbatches,
        "schedule": args.schedule,
        "stages_per_rank": args.stages_per_rank,
        "budget": args.budget,
        "optimizer_state": args.optimizer_state,
        "offload": args.offload,
        "overhead": None if args.overhead_ms is None else args.overhead_ms / 1e3,
        "latency": None if args.latency_ms is None else args.latency_ms / 1e3,
    }
    return PipelineOptions(**{k: v for k, v in given.items() if v is not None})


def _ranks(args: argparse.Namespace) -> int:
    """``--ranks``, or the deprecated ``--stages`` (which counted ranks), with a note."""
    if args.deprecated_stages is not None:
        if args.ranks is not None:
            raise CliError("give --ranks K only (--stages is its deprecated spelling)")
        print(
            "memfit: warning: --stages is deprecated and will be removed in the next release; "
            f"it counted ranks: write --ranks {args.deprecated_stages}",
            file=sys.stderr,
        )
        return int(args.deprecated_stages)
    if args.ranks is None:
        raise CliError("--ranks K is required: the ranks (processes, one device each)")
    return int(args.ranks)


def run(args: argparse.Namespace, console: Any) -> int:
    ranks = _ranks(args)
    if args.microbatches is None and args.schedule != AUTO:
        raise CliError("--microbatches is required unless --schedule auto (which chooses it)")
    for flag, value in (
        ("--ranks", ranks),
        ("--microbatches", args.microbatches),
        ("--stages-per-rank", args.stages_per_rank),
    ):
        if value is not None and value < 1:
            raise CliError(f"{flag} {value}: must be at least 1")
    if args.steps < 1:
        raise CliError(f"--steps {args.steps}: must be at least 1")
    options = pipeline_options(args)
    model, inputs = _inputs(args.target)
    try:
        planned = plan(model, inputs, ranks=ranks, options=options)
    except ValueError as err:  # BudgetError is one: a budget no split fits, before any process
        raise CliError(str(err)) from err
    console.print(str(planned), highlight=False, markup=False)
    if not args.execute:
        return 0
    # auto's choices, so the ranks do not choose again
    chosen = dataclasses.replace(
        options,
        schedule=planned.schedule,
        stages_per_rank=planned.stages_per_rank,
        microbatches=planned.microbatches,
    )
    console.print(f"running {ranks} processes (gloo) ...", highlight=False)
    results = launch(
        _rank, ranks, args=(args.target, ranks, chosen, args.steps), timeout=args.timeout
    )
    step = max(r["step_seconds"] for r in results)
    busy = statistics.fmean(r["stage_seconds"] for r in results) * planned.microbatches
    lines = [f"{'stage':>5} {'predicted peak':>15} {'measured peak':>14} {'ratio':>6}"]
    for rank, r in enumerate(results):
        # a rank's, all its stages' together when it holds several (interleaved and V schedules)
        predicted = r["predicted_peak"]
        ratio = r["peak_bytes"] / predicted if predicted else float("nan")
        lines.append(
            f"{rank:>5} {format_bytes(predicted):>15} "
            f"{format_bytes(r['peak_bytes']):>14} {ratio:>6.2f}"
        )
    k, m = ranks, planned.microbatches
    lines.append(
        f"step: measured {step * 1e3:.1f} ms, predicted {planned.step_seconds * 1e3:.1f} ms; "
        f"bubble measured {max(0.0, 1 - busy / step):.1%}, predicted {planned.bubble:.1%}, "
        f"(K-1)/(M+K-1) = {equal_stages_bubble(k, m):.1%}"
    )
    lines.append("peaks are above what is live before a step (state and buffers excluded)")
    console.print("\n".join(lines), highlight=False, markup=False)
    return 0
