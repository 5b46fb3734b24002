"""``memfit profile TARGET``: where a user's model spends its training memory, and what fits.

For the model a factory builds (see ``memfit.cli.target``) this reports, all measured:

1. activation memory by submodule and the largest tensors kept for backward (one eager step of
   plain PyTorch with saved-tensor hooks; ``memfit.measurement.activations`` says exactly how);
2. per policy (``--policies``, ``none`` always first): measured and predicted peak, step time,
   recomputed FLOPs (``memfit.cli.steps``), and a PNG of memory over one step per policy;
3. with ``--budget``: the largest batch whose whole training step fits, per policy, searched with
   real steps (``memfit.cli.batch_search``);
4. with ``--pareto``: the budget planner's frontier of predicted peak against recompute cost, as a
   PNG (``memfit.plan(..., policy=1.0).pareto()``);
5. with ``--json``: all of it as ``profile.json`` (schema in ``memfit.cli.report``).

Files go to ``--out`` (default ``memfit-profile`` in the temporary directory, never the working
directory), and the paths are printed at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

import memfit
from memfit._compat import keystr, tree_flatten_with_path
from memfit.cli import report as rep
from memfit.cli.arguments import (
    POLICY_NAMES,
    Command,
    parse_batch_budget,
    parse_device,
    parse_dtype,
    parse_policies,
    parse_shape,
)
from memfit.cli.batch_search import Probe, batch_size_of, measure_probe, search_max_batch
from memfit.cli.errors import CliError, first_line
from memfit.cli.figures import pareto_figure, timeline_figure
from memfit.cli.steps import (
    PolicyResult,
    Workload,
    plain_peak_bytes,
    resident_bytes,
    run_policies,
)
from memfit.cli.tables import batch_table, mib, module_table, policy_table, tensor_table
from memfit.cli.target import build_target, move_inputs
from memfit.measurement.activations import saved_activations
from memfit.planning.policy import Policy
from memfit.units import format_bytes

__all__ = ["add_parser", "run"]

#: Where the figures and the JSON go without ``--out``: outside the working tree.
DEFAULT_OUT = Path(tempfile.gettempdir()) / "memfit-profile"

EXAMPLES = """\
examples:
  memfit profile examples/resnet.py:make --budget 128MiB --pareto
  memfit profile mypkg.models:build --input-shape 16,3,224,224 --policies none,memory --json
  memfit profile train.py:model_and_batch --device cuda --dtype bfloat16 --budget 20GiB

The factory takes no arguments and returns (model, example_inputs), example_inputs being a
tensor, a tuple of positional arguments or a dict of keyword arguments; or only the model
when --input-shape is given. The loss of a step is the model's output if it is a scalar, its
'loss' if it has one, else the sum of its floating-point outputs.
"""

COMMAND = Command(
    "profile",
    help="measure where your model's training memory goes",
    description="Measure a training step of your model: activation memory by submodule, "
    "the largest tensors kept, peak and step time per memfit policy, and with "
    "--budget the largest batch that fits.",
    examples=EXAMPLES,
)

ACTIVATIONS_METHOD = (
    "one eager training step of plain PyTorch; every storage autograd saves for backward "
    "(saved_tensors_hooks), counted once, without parameters, buffers and inputs, credited to "
    "the innermost submodule running when an ATen op created it (TorchDispatchMode)"
)

BUDGET_COVERS = (
    "parameters + buffers + the batch (live before the step) + the peak measured above them "
    "during forward, loss and backward (activations, gradients, scratch); not optimizer state"
)


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = COMMAND.add_to(sub, parents)
    _add_target_arguments(p)
    _add_policy_arguments(p)
    _add_batch_arguments(p)
    _add_output_arguments(p)
    p.set_defaults(run=run)
    return p


def _add_target_arguments(p: argparse.ArgumentParser) -> None:
    """What model is profiled, on what inputs, device and dtype."""
    p.add_argument(
        "target", metavar="TARGET", help="path/to/file.py:factory or package.module:factory"
    )
    p.add_argument(
        "--input-shape",
        action="append",
        default=[],
        metavar="SHAPE",
        help="the factory returns only the model; make one random input of this "
        "shape (e.g. 8,3,32,32); repeat for several inputs",
    )
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    p.add_argument(
        "--dtype",
        help="cast parameters and floating inputs: float32, bfloat16, "
        "float16, float64 (default: as the factory made them)",
    )


def _add_policy_arguments(p: argparse.ArgumentParser) -> None:
    """Which policies run, and how memfit runs their plans (executor, offload)."""
    p.add_argument(
        "--policies",
        default="none,speed,memory",
        help=f"comma-separated policies: {POLICY_NAMES}, or a budget (a fraction such as 0.5 "
        "or a size such as 2GiB) (default: none,speed,memory; none is always run, as the "
        "baseline)",
    )
    p.add_argument(
        "--offload",
        action="store_true",
        help="also run 'swap' and, for memory and every budget policy, the same policy with "
        "offload (activations to host memory on CUDA, to disk on CPU)",
    )
    p.add_argument("--offload-to", choices=["host", "disk"], help="where offloaded values go")
    p.add_argument(
        "--executor",
        choices=[str(e) for e in memfit.Executor],
        default="eager",
        help="how memfit runs its plans: eager (ATen kernels, gradients bit-equal to plain "
        "PyTorch) or inductor (torch.compile's fused kernels, to float tolerance)",
    )
    p.add_argument(
        "--autotune",
        action="store_true",
        help="with --executor inductor: time each budget's plan against speed's once both are "
        "compiled and keep the faster (one more compile on the first step)",
    )
    p.add_argument(
        "--offload-dir",
        metavar="DIR",
        help="directory for disk offload files (a private subdirectory is made and removed)",
    )


def _add_batch_arguments(p: argparse.ArgumentParser) -> None:
    """The largest-batch search under ``--budget``."""
    p.add_argument(
        "--budget",
        metavar="BYTES",
        help="find the largest batch per policy whose training step fits in this much "
        "device memory (weights + batch + measured peak): e.g. 2GiB, 800MB, "
        "512KiB or bytes",
    )
    p.add_argument(
        "--batch-dim",
        type=int,
        default=0,
        metavar="DIM",
        help="dimension of the inputs that is the batch (default 0)",
    )
    p.add_argument(
        "--batch-step",
        type=int,
        default=1,
        metavar="N",
        help="search batches that are multiples of N (default 1)",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=65536,
        metavar="N",
        help="largest batch the search tries (default 65536)",
    )


def _add_output_arguments(p: argparse.ArgumentParser) -> None:
    """How much is measured and what is written where."""
    p.add_argument(
        "--timing-runs",
        type=int,
        default=3,
        metavar="N",
        help="timed steps per policy; the median is reported (default 3)",
    )
    p.add_argument(
        "--pareto",
        action="store_true",
        help="also plot the budget planner's predicted peak vs recompute frontier",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="write OUT/profile.json (schema: memfit.cli.report.REPORT_SCHEMA)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        metavar="DIR",
        help=f"directory for the figures and the JSON (default: {DEFAULT_OUT}, in "
        "the temporary directory, so nothing is written to the working "
        "directory)",
    )


def _check_ints(args: argparse.Namespace) -> None:
    for flag, value, least in (
        ("--batch-dim", args.batch_dim, 0),
        ("--batch-step", args.batch_step, 1),
        ("--max-batch", args.max_batch, 1),
        ("--timing-runs", args.timing_runs, 1),
    ):
        if value < least:
            raise CliError(f"{flag} {value}: must be at least {least}")
    if args.max_batch < args.batch_step:
        raise CliError(f"--max-batch {args.max_batch} is below --batch-step {args.batch_step}")


def _device_memory(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _input_entries(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[dict[str, Any]]:
    leaves, _ = tree_flatten_with_path((args, kwargs))
    out = []
    for path, leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            name = keystr(path)
            name = ("args" + name[3:]) if name.startswith("[0]") else ("kwargs" + name[3:])
            out.append(
                {
                    "name": name,
                    "shape": list(leaf.shape),
                    "dtype": str(leaf.dtype).removeprefix("torch."),
                }
            )
    return out


def _options(args: argparse.Namespace) -> memfit.Options:
    try:
        return memfit.Options(offload_to=args.offload_to, offload_dir=args.offload_dir)
    except (ValueError, memfit.OffloadError) as err:
        raise CliError(f"--offload-dir/--offload-to: {err}") from None


@dataclasses.dataclass
class _Profiled:
    """The model a factory built, moved and cast, and what ``run`` measured of it."""

    model: torch.nn.Module
    work: Workload
    #: the model's class name, and its parameters' dtypes
    name: str
    dtypes: list[str]
    n_params: int
    param_bytes: int
    acts: Any = None
    results: list[PolicyResult] = dataclasses.field(default_factory=list)
    frontier: list[Any] | None = None
    searches: list[Any] = dataclasses.field(default_factory=list)
    #: plain PyTorch's measured peak of one step: what the savings are quoted against
    plain_peak_bytes: int | None = None


def run(args: argparse.Namespace, console: Any) -> int:
    device = parse_device(args.device)
    dtype = parse_dtype(args.dtype)
    if args.autotune and args.executor != "inductor":
        raise CliError("--autotune times plans as Inductor compiles them: add --executor inductor")
    policies = parse_policies(args.policies, offload=args.offload, autotune=args.autotune)
    options = _options(args)
    budget = parse_batch_budget(args.budget) if args.budget is not None else None
    shapes = [parse_shape(s) for s in args.input_shape]
    _check_ints(args)
    started = time.perf_counter()

    target = build_target(args.target, shapes)
    model = target.model.to(device=device, dtype=dtype) if dtype else target.model.to(device)
    model.train()
    inputs = move_inputs((target.args, target.kwargs), device, dtype)
    work = Workload(
        model, tuple(inputs[0]), dict(inputs[1]), options=options, executor=args.executor
    )
    weights, batch_bytes = resident_bytes(model, work.args, work.kwargs)
    batch = batch_size_of(work.args, work.kwargs, args.batch_dim) if budget else None
    if budget is not None:
        _check_budget(args.budget, budget, weights, device)
    profiled = _Profiled(
        model,
        work,
        name=type(model).__name__,
        dtypes=sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()}),
        n_params=sum(p.numel() for p in model.parameters()),
        param_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
    )
    console.print(
        f"[bold]memfit profile[/bold] {args.target}: {profiled.name}, {profiled.n_params:,} "
        f"parameters ({mib(profiled.param_bytes)}, {', '.join(profiled.dtypes) or '-'}), inputs "
        f"{mib(batch_bytes)}, on {device}"
    )
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        _measure(args, profiled, policies, device, progress)
        if budget is not None:
            profiled.searches = _search_batches(
                args, work, policies, device, budget, batch or 1, progress
            )
    _print_tables(args, console, profiled)
    written = _write_files(args, profiled, device, budget)
    console.print(
        f"\nWrote {', '.join(f'[bold]{p}[/bold]' for p in written)} "
        f"({time.perf_counter() - started:.0f} s)."
    )
    console.print(_next_step(profiled.results, budget is not None, args.executor))
    return 0


def _check_budget(written: str, budget: int, weights: int, device: torch.device) -> None:
    """``--budget`` (``written`` as given) must hold the model's weights and fit the device."""
    if budget < weights:
        raise CliError(
            f"--budget {written} ({format_bytes(budget)}) is smaller than the "
            f"model's parameters and buffers ({format_bytes(weights)}), which every "
            "training step holds; give a larger budget"
        )
    total = _device_memory(device)
    if total is not None and budget > total:
        raise CliError(
            f"--budget {written} ({format_bytes(budget)}) is more than this "
            f"{device.type} device has ({format_bytes(total)}); the search would "
            "run out of memory before reaching it"
        )


def _measure(
    args: argparse.Namespace,
    profiled: _Profiled,
    policies: list[Policy],
    device: torch.device,
    progress: Progress,
) -> None:
    """Activations by submodule, one step per policy, and with ``--pareto`` the frontier."""
    work = profiled.work
    task = progress.add_task("activations: one eager step with saved-tensor hooks", total=1)
    try:
        profiled.acts = saved_activations(profiled.model, work.args, work.kwargs, work.loss)
    except Exception as err:
        raise CliError(
            f"{args.target}: a training step of the model on its example inputs "
            f"raised {first_line(err)}"
        ) from err
    progress.update(task, advance=1, description="activations attributed")
    task = progress.add_task("plain PyTorch: one measured step", total=1)
    profiled.plain_peak_bytes = plain_peak_bytes(work, device)
    progress.update(task, advance=1, description="plain PyTorch measured")
    profiled.results = run_policies(work, policies, device, args.timing_runs, progress)
    if args.pareto:
        task = progress.add_task("pareto: planning with budget 100%", total=1)
        plan = memfit.plan(profiled.model, *work.args, policy=1.0, **work.kwargs)
        profiled.frontier = list(plan.pareto())
        progress.update(task, advance=1, description="pareto frontier planned")


def _search_batches(
    args: argparse.Namespace,
    work: Workload,
    policies: list[Policy],
    device: torch.device,
    budget: int,
    start: int,
    progress: Progress,
) -> list[Any]:
    """The largest batch within ``budget`` for each policy, found by real steps from ``start``."""
    searches = []
    for policy in policies:
        task = progress.add_task(f"{policy.label}: largest batch within {args.budget}", total=None)

        def on_probe(p: Any, task: Any = task, policy: Policy = policy) -> None:
            state = "fits" if p.fits else "over"
            progress.update(task, description=f"{policy.label}: batch {p.batch} {state}")

        def probe(batch: int, policy: Policy = policy, budget: int = budget) -> Probe:
            return measure_probe(work, policy, device, budget, args.batch_dim, batch)

        searches.append(
            search_max_batch(
                probe,
                label=policy.label,
                budget_bytes=budget,
                start=start,
                step=args.batch_step,
                limit=args.max_batch,
                on_probe=on_probe,
            )
        )
        progress.update(
            task,
            total=1,
            completed=1,
            description=f"{policy.label}: largest batch {searches[-1].max_batch}",
        )
    return searches


def _print_tables(args: argparse.Namespace, console: Any, profiled: _Profiled) -> None:
    """The activation, tensor, policy and batch tables, and recapture warnings."""
    acts, name, results = profiled.acts, profiled.name, profiled.results
    console.print(module_table(acts, name))
    console.print(
        f"Plain autograd saves {mib(acts.total_bytes)} for backward; memfit's 'none' "
        f"plan keeps {mib(results[0].plan.kept_bytes)}.",
        highlight=False,
    )
    console.print(tensor_table(acts, name))
    console.print(
        policy_table(
            results,
            title="one training step per policy (forward + loss + backward)",
            plain_peak_bytes=profiled.plain_peak_bytes,
        )
    )
    for r in results:
        if r.recaptured:
            console.print(
                f"[yellow]warning: {r.label} was captured again while being measured; "
                "its numbers include a recompilation[/yellow]"
            )
    if profiled.searches:
        console.print(batch_table(profiled.searches, f"{args.budget}"))


def _write_files(
    args: argparse.Namespace, profiled: _Profiled, device: torch.device, budget: int | None
) -> list[Path]:
    """The timeline PNG, with ``--pareto`` the frontier's, with ``--json`` the report."""
    args.out.mkdir(parents=True, exist_ok=True)
    name, results, frontier = profiled.name, profiled.results, profiled.frontier
    title = f"{name} ({args.target}), one training step on {device.type}"
    png = timeline_figure(results, args.out / "timeline.png", title)
    pareto_png = None
    if frontier is not None:
        pareto_png = pareto_figure(
            frontier, args.out / "pareto.png", f"{name}: predicted peak vs recomputation", results
        )
    written = [png] + ([pareto_png] if pareto_png else [])
    if args.json:
        figures = {"timeline": str(png), "pareto": str(pareto_png) if pareto_png else None}
        report = _report(args, profiled, device, budget, figures)
        problems = rep.validate(report)
        if problems:  # a bug in memfit, not in the user's input
            raise RuntimeError("the report does not match its schema: " + "; ".join(problems[:3]))
        json_path = args.out / "profile.json"
        json_path.write_text(json.dumps(report, indent=2) + "\n")
        written.append(json_path)
    return written


def _report(
    args: argparse.Namespace,
    profiled: _Profiled,
    device: torch.device,
    budget: int | None,
    figures: dict[str, str | None],
) -> dict[str, Any]:
    """``profile.json``'s content (``memfit.cli.report.REPORT_SCHEMA``)."""
    work, results, frontier = profiled.work, profiled.results, profiled.frontier
    base = results[0]
    return {
        "schema": rep.SCHEMA_ID,
        "memfit_version": memfit.__version__,
        "torch_version": torch.__version__,
        "target": args.target,
        "model": profiled.name,
        "device": str(device),
        "dtype": profiled.dtypes[0] if len(profiled.dtypes) == 1 else None,
        "batch_dim": args.batch_dim,
        "batch_size": _batch_or_none(work, args.batch_dim),
        "parameters": {"count": profiled.n_params, "bytes": profiled.param_bytes},
        "buffers_bytes": sum(b.numel() * b.element_size() for b in profiled.model.buffers()),
        "inputs": _input_entries(work.args, work.kwargs),
        "activations": rep.activations_entry(
            profiled.acts, ACTIVATIONS_METHOD, base.plan.kept_bytes
        ),
        "policies": [rep.policy_entry(r, base, args.executor) for r in results],
        "max_batch": None
        if budget is None
        else {
            "budget_bytes": budget,
            "covers": BUDGET_COVERS,
            "batch_step": args.batch_step,
            "limit": args.max_batch,
            "results": [rep.search_entry(s) for s in profiled.searches],
        },
        "pareto": None
        if frontier is None
        else [
            {
                "peak_bytes": int(p.peak_bytes),
                "recompute_flops": int(p.recompute_flops),
                "recompute_seconds": float(p.recompute_seconds),
            }
            for p in frontier
        ],
        "figures": figures,
    }


def _next_step(results: list[PolicyResult], searched: bool, executor: str = "eager") -> str:
    """One line on what to try next, from what was measured (with memfit's ``executor``)."""
    base, others = results[0], results[1:]
    best = min(others, key=lambda r: r.peak_bytes, default=None)
    if best is None:
        return "Next: add --policies none,speed,memory to compare memfit's policies."
    if best.peak_bytes > 0.9 * base.peak_bytes:
        return (
            f"Next: activations are a small part of this step (the best policy, {best.label}, "
            f"peaks at {mib(best.peak_bytes)} against {mib(base.peak_bytes)}); try a larger "
            "batch (--budget finds the largest that fits) or a deeper model."
        )
    hint = "" if searched else ", or add --budget 2GiB to find the largest batch that fits"
    return (
        f"Next: train with [bold]{best.policy.call(executor=executor)}[/bold] "
        f"({mib(best.peak_bytes)} instead "
        f"of {mib(base.peak_bytes)} per step){hint}."
    )


def _batch_or_none(work: Workload, batch_dim: int) -> int | None:
    try:
        return batch_size_of(work.args, work.kwargs, batch_dim)
    except CliError:
        return None
