"""``memfit fit TARGET --device NAME``: will a training step fit on a device that is not here.

TARGET is a Hugging Face ``config.json`` (a file, a folder holding one, or a model id already in
the local Hugging Face cache: nothing is downloaded), or a factory as ``memfit profile`` takes
it (``memfit.cli.target``). A config's model is built under ``torch.device("meta")`` with
transformers' ``AutoModelForCausalLM.from_config`` (masked-LM and seq2seq configs with their
Auto classes), on ``input_ids`` and ``labels`` of ``--batch`` x ``--seq``, so the model computes
its own loss; planning it needs ``memfit.plan`` to plan meta models (``fitting.step_plan``). A
factory's model is planned where it is built (CPU), its inputs resized to ``--batch`` (and
``--seq`` along ``--seq-dim``).

For each policy it prints weights, gradients, optimizer state and temporaries, activations and
the whole step's predicted peak (``memfit.fitting.device_fit``, the ``max_memory_allocated``
counter), whether it fits in the device's memory less its CUDA context, the largest batch (and
sequence length) that fits, and a roofline step time, an estimate. ``--json`` prints the same as
JSON instead; ``--png PATH`` draws the bytes per policy against the device. When the asked batch
fits under no policy, the exit status is 1 and the last line says what would fit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memfit.analysis.devices import Device, get_device, known_devices
from memfit.analysis.step_memory import IMPLEMENTATIONS, OPTIMIZERS
from memfit.cli.arguments import Command, parse_dtype, parse_policies
from memfit.cli.errors import CliError, first_line
from memfit.cli.tables import mib
from memfit.cli.target import build_target, move_inputs
from memfit.fitting import FitReport, fit
from memfit.fitting.step_plan import size_of, with_size
from memfit.planning.budget import parse_budget

__all__ = ["add_parser", "run", "load_config_model", "fit_figure"]

EXAMPLES = """\
examples:
  memfit fit path/to/config.json --device h100-80gb --batch 8 --seq 4096 --dtype bfloat16
  memfit fit meta-llama/Llama-3.1-8B --device h200 --batch 4 --seq 8192 --optimizer adamw
  memfit fit model.py:make --device l4 --batch 64 --policies none,memory --json

Devices: a100-40gb, a100-80gb, h100-80gb, h200, l4, rtx-4090 (--capacity for a part of one).
A config is built on the meta device (nothing allocated); a factory's model is planned on CPU.
"""

COMMAND = Command(
    "fit",
    help="will a training step fit on a GPU you do not have",
    description="Predict a training step's memory on a device per memfit policy: weights, "
    "gradients, optimizer state, activations and the peak, whether it fits, the largest "
    "batch that does, and an estimated step time.",
    examples=EXAMPLES,
)

#: Auto classes tried for a config, in order: the first that accepts the config builds it.
_AUTO_CLASSES = ("AutoModelForCausalLM", "AutoModelForMaskedLM", "AutoModelForSeq2SeqLM")


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = COMMAND.add_to(sub, parents)
    p.add_argument(
        "target",
        metavar="TARGET",
        help="a config.json (file or folder), a model id in the local Hugging Face cache, or "
        "path/to/file.py:factory as memfit profile takes it",
    )
    p.add_argument(
        "--device",
        default="h100-80gb",
        metavar="NAME",
        help=f"the device to plan for: {', '.join(known_devices())} (default h100-80gb)",
    )
    p.add_argument(
        "--capacity",
        metavar="BYTES",
        help="plan for this much device memory instead of the device's (e.g. 40GiB: what "
        "other processes leave)",
    )
    p.add_argument("--batch", type=int, metavar="N", help="batch size (default: 1 for a config, "
                   "the factory's for a factory)")  # fmt: skip
    p.add_argument("--seq", type=int, metavar="N", help="sequence length (default: 1024 for a "
                   "config; a factory's inputs are kept unless given)")  # fmt: skip
    p.add_argument("--seq-dim", type=int, default=1, metavar="DIM",
                   help="a factory's input dimension that is the sequence (default 1)")  # fmt: skip
    p.add_argument("--batch-dim", type=int, default=0, metavar="DIM",
                   help="a factory's input dimension that is the batch (default 0)")  # fmt: skip
    p.add_argument(
        "--dtype",
        help="the weights' dtype: float32, bfloat16, float16 (default: float32; bfloat16 "
        "is pure bf16 training: gradients and optimizer state in bf16 too)",
    )
    p.add_argument(
        "--autocast",
        metavar="DTYPE",
        help="compute under torch.autocast in this dtype (bfloat16, float16), weights kept "
        "in --dtype",
    )
    p.add_argument(
        "--optimizer",
        default="adamw",
        help=f"{', '.join(OPTIMIZERS)} or none (default adamw; sgd has momentum)",
    )
    p.add_argument(
        "--implementation",
        choices=IMPLEMENTATIONS,
        help="the optimizer's implementation (default: foreach, torch's on CUDA)",
    )
    p.add_argument(
        "--policies",
        default="none,speed,memory",
        help="comma-separated policies, as memfit profile takes them (default none,speed,memory)",
    )
    p.add_argument("--max-batch", type=int, default=65536, metavar="N",
                   help="largest batch (and sequence length) searched (default 65536)")  # fmt: skip
    p.add_argument("--no-search", action="store_true",
                   help="only the asked batch: no largest-batch search")  # fmt: skip
    p.add_argument("--png", type=Path, metavar="PATH", help="draw the bytes per policy here")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead")
    p.set_defaults(run=run)
    return p


def _device(args: argparse.Namespace) -> Device:
    try:
        device = get_device(args.device)
    except ValueError as err:
        raise CliError(f"--device: {err}") from None
    if args.capacity is not None:
        try:
            budget = parse_budget(args.capacity)
        except (TypeError, ValueError) as err:
            raise CliError(f"--capacity {args.capacity!r}: {err}") from None
        if budget.bytes is None:
            raise CliError(
                f"--capacity {args.capacity!r} is a fraction; give bytes or a size, e.g. 40GiB"
            )
        device = dataclasses.replace(device, capacity_bytes=budget.bytes)
        if device.usable_bytes <= 0:
            raise CliError(
                f"--capacity {args.capacity}: at most the CUDA context "
                f"({mib(device.context_bytes)}) of {device.name}; give more"
            )
    return device


def _is_config(spec: str) -> bool:
    """A config (file, folder, or model id) rather than a factory ``where:name``."""
    path = Path(spec).expanduser()
    if path.exists():
        return not spec.endswith(".py")
    where, sep, name = spec.rpartition(":")
    return not (sep and where and all(part.isidentifier() for part in name.split(".")))


def load_config_model(spec: str, dtype: torch.dtype | None) -> nn.Module:
    """The model of a Hugging Face config, built on the meta device (see the module docstring)."""
    try:
        import transformers
    except ImportError as err:
        raise CliError(
            f"{spec}: reading a Hugging Face config needs transformers (pip install "
            f"'memfit[integrations]')"
        ) from err
    path = Path(spec).expanduser()
    source = str(path.parent if path.is_file() else path) if path.exists() else spec
    try:
        if path.is_file():
            config = transformers.AutoConfig.from_pretrained(str(path))
        else:
            config = transformers.AutoConfig.from_pretrained(source, local_files_only=True)
    except Exception as err:
        where = (
            "not a Hugging Face config transformers can read"
            if path.exists()
            else "not a file, and no such model in the local Hugging Face cache (memfit fit "
            "downloads nothing)"
        )
        raise CliError(
            f"{spec}: {where}: {first_line(err)}; give a config.json, a folder holding one, or "
            f"the id of a model downloaded before"
        ) from err
    errors = []
    for name in _AUTO_CLASSES:
        auto = getattr(transformers, name)
        try:
            with torch.device("meta"):
                model = auto.from_config(config, dtype=dtype or torch.float32)
        except ValueError as err:  # this Auto class has no model for the config
            errors.append(f"{name}: {first_line(err)}")
            continue
        except Exception as err:
            raise CliError(
                f"{spec}: transformers could not build a {config.model_type} model from this "
                f"config with {name}: {first_line(err)}"
            ) from err
        model.train()
        return model
    raise CliError(
        f"{spec}: no causal-LM, masked-LM or seq2seq model for model_type "
        f"{config.model_type!r} ({'; '.join(errors)[:300]})"
    )


def _config_inputs(model: nn.Module, batch: int, seq: int) -> dict[str, torch.Tensor]:
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return {"input_ids": ids, "labels": ids}


def _workload(
    args: argparse.Namespace,
) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any], int, int | None]:
    """The model, its inputs at the asked sizes, the sequence dimension (-1: none) and the
    longest sequence the model takes (None: not known)."""
    dtype = parse_dtype(args.dtype)
    if _is_config(args.target):
        model = load_config_model(args.target, dtype)
        longest = getattr(model.config, "max_position_embeddings", None)
        batch = args.batch or 1
        seq = args.seq or min(1024, int(longest or 1024))
        return model, (), _config_inputs(model, batch, seq), 1, longest
    target = build_target(args.target)
    model, call_args, kwargs = target.model, target.args, target.kwargs
    if dtype is not None:
        model = model.to(dtype)
        call_args, kwargs = move_inputs((call_args, kwargs), torch.device("cpu"), dtype)
    value: Any = (call_args, kwargs)
    try:
        if args.batch:
            old = size_of(call_args, kwargs, args.batch_dim)
            value = with_size(value, args.batch_dim, old, args.batch)
        if args.seq:
            old = size_of(value[0], value[1], args.seq_dim)
            value = with_size(value, args.seq_dim, old, args.seq)
    except ValueError as err:
        raise CliError(f"{args.target}: {err}") from None
    call_args, kwargs = value
    return model, tuple(call_args), dict(kwargs), args.seq_dim if args.seq else -1, None


def run(args: argparse.Namespace, console: Any) -> int:
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    device = _device(args)
    optimizer = args.optimizer.lower()
    if optimizer not in (*OPTIMIZERS, "none"):
        raise CliError(
            f"--optimizer {args.optimizer!r} is not modelled; memfit counts the state and step "
            f"temporaries of {', '.join(OPTIMIZERS)} (or none: weights and gradients only)"
        )
    autocast = parse_dtype(args.autocast)
    if autocast not in (None, torch.bfloat16, torch.float16):
        raise CliError(f"--autocast {args.autocast!r}: autocast computes in bfloat16 or float16")
    if args.max_batch < 1 or (args.batch is not None and args.batch < 1):
        raise CliError("--batch and --max-batch must be at least 1")
    policies = parse_policies(args.policies)
    model, call_args, kwargs, seq_dim, longest = _workload(args)
    batch_dim = 0 if _is_config(args.target) else args.batch_dim

    progress = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
        disable=not sys.stderr.isatty(),
    )
    with progress:
        task = progress.add_task(f"planning for {device.name}", total=None)

        def planned(policy: str, batch: int, seq: int | None, peak: int) -> None:
            at = f"batch {batch}" + (f", seq {seq}" if seq is not None else "")
            progress.update(task, description=f"{policy}: {at}: {mib(peak)}")

        report = fit(
            model,
            *call_args,
            device=device,
            policies=policies,
            optimizer=optimizer,
            implementation=args.implementation,
            autocast=autocast,
            batch_dim=batch_dim,
            seq_dim=seq_dim if seq_dim >= 0 else None,
            search=not args.no_search,
            limit=args.max_batch,
            seq_limit=min(args.max_batch, longest) if longest else None,
            on_plan=planned,
            **kwargs,
        )
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        console.print(fit_table(report))
        console.print(_footnote(report))
    if args.png is not None:
        fit_figure(report, args.png)
        if not args.json:
            console.print(f"figure: {args.png}")
    message = report.no_fit_message()
    if message is not None:
        print(f"memfit: {message}", file=sys.stderr)
        return 1
    return 0


def fit_table(report: FitReport) -> Any:
    from rich.table import Table

    d = report.device
    table = Table(
        title=f"{d.title}: {mib(d.usable_bytes)} for tensors ({mib(d.capacity_bytes)} less "
        f"{mib(d.context_bytes)} of CUDA context); {report.optimizer} ({report.implementation})"
    )
    seqs = any(r.largest_seq is not None for r in report.rows)
    columns = ["policy", "batch", "weights", "gradients", "optimizer", "activations", "peak"]
    columns += ["fits", "largest batch"] + (["largest seq"] if seqs else []) + ["est. step"]
    for name in columns:
        table.add_column(name, justify="left" if name == "policy" else "right")
    for r in report.rows:
        cells = [
            r.policy,
            str(r.batch) + (f" x {r.seq}" if r.seq is not None else ""),
            mib(r.weights_bytes),
            mib(r.gradient_bytes),
            mib(r.optimizer_bytes + r.optimizer_temp_bytes),
            mib(r.activation_bytes),
            mib(r.peak_bytes),
            "yes" if r.fits else "no",
            _largest(r.largest_batch, r.exact),
        ]
        if seqs:
            cells.append(_largest(r.largest_seq, r.exact))
        cells.append(_seconds(r.step_seconds))
        table.add_row(*cells)
    return table


def _largest(value: int | None, exact: bool) -> str:
    if value is None:
        return "-"
    return str(value) if exact else f"~{value}"


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1e3:.3g} ms" if value < 10 else f"{value:.1f} s"


def _footnote(report: FitReport) -> str:
    return (
        f"peak: predicted max_memory_allocated of a whole step (weights, batch, optimizer state, "
        f"and the larger of forward+backward and optimizer.step()); optimizer: state and step "
        f"temporaries; activations planned on {report.planned_on}. est. step: roofline at the "
        f"device's peak FLOP/s and bandwidth, recomputation included, an estimate (a lower "
        f"bound). docs/fit.md says what is counted."
    )


def fit_figure(report: FitReport, path: Path) -> None:
    """Stacked bars per policy (weights, gradients, optimizer, activations, batch) against the
    device's memory for tensors."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit, scale = ("GiB", 2**30) if report.usable_bytes >= 2**30 else ("MiB", 2**20)
    parts = {
        "weights": [r.weights_bytes for r in report.rows],
        "gradients": [r.gradient_bytes for r in report.rows],
        "optimizer": [r.optimizer_bytes + r.optimizer_temp_bytes for r in report.rows],
        "activations": [r.activation_bytes for r in report.rows],
        "batch": [r.input_bytes for r in report.rows],
    }
    labels = [r.policy for r in report.rows]
    fig, ax = plt.subplots(figsize=(1.6 * len(labels) + 4, 4.5))
    bottom = [0.0] * len(labels)
    for name, values in parts.items():
        ax.bar(labels, [v / scale for v in values], bottom=bottom, width=0.6, label=name)
        bottom = [b + v / scale for b, v in zip(bottom, values)]
    peaks = [r.peak_bytes / scale for r in report.rows]
    ax.hlines(peaks, [i - 0.35 for i in range(len(labels))], [i + 0.35 for i in range(len(labels))],
              color="black", linewidth=2.5, label="peak", zorder=3)  # fmt: skip
    ax.axhline(report.usable_bytes / scale, color="black", linestyle=":",
               label=f"{report.device.name} for tensors")  # fmt: skip
    ax.set_ylabel(unit)
    ax.set_title(
        f"training step on {report.device.title}\nbars: each part; tick: the peak (the larger "
        f"of forward+backward and optimizer.step())",
        fontsize="medium",
    )
    ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    os.makedirs(path.parent if str(path.parent) else ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
