"""Depth sweep of memfit against plain PyTorch and checkpoint_sequential (memfit.bench.depth_sweep).

The repository's script for the sweep ``memfit bench depth-sweep`` runs: the same options, but it
writes to this repository's ``benchmarks/results`` wherever it is run from (``--out``
elsewhere), and after a full sweep it rewrites the summary table in ``benchmarks/README.md``
(between the ``<!-- depth-sweep:begin -->`` and ``<!-- depth-sweep:end -->`` markers;
``depth-sweep_cuda`` for CUDA) from the JSON it wrote. That README is this repository's, so that
step lives here and not in the installed package, which never writes a README. ``--quick``
writes ``depth_sweep_quick.*`` and leaves the README alone.

Run with the Python of the environment memfit is installed in (``pip install -e .``; the
Makefile's ``.venv``): ``python benchmarks/depth_sweep.py [--quick] [--device cuda]``.
"""

from __future__ import annotations

import os

# Read by OpenMP when torch loads, so it must be set before the imports below; see the module.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from memfit.bench.depth_sweep import METHODS, add_arguments, format_ratio, run  # noqa: E402
from memfit.units import MIB  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "benchmarks" / "README.md"


def marker(suffix: str = "") -> tuple[str, str]:
    """The comments around the sweep's table in the README (``suffix``: ``_cuda`` for CUDA)."""
    name = "depth-sweep" + suffix
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def readme_block(report: dict[str, Any]) -> str:
    """The README's summary of a sweep: one sentence of conditions, then peak and time ratios."""
    results = report["results"]
    params, machine = report["parameters"], report["machine"]
    errors = [
        abs(rec["predicted_peak_bytes"] - rec["peak_bytes"]) / MIB
        for res in results
        for name, rec in res["methods"].items()
        if name.startswith("memfit-") and "peak_bytes" in rec and "predicted_peak_bytes" in rec
    ]
    worst = max(errors, default=0.0)
    where = (
        machine.get("gpu")
        or f"a {machine.get('cpu_count')}-core "
        f"{machine.get('cpu_model') or machine.get('processor')}"
    )
    lines = [
        f"Peak memory of one training step relative to plain eager PyTorch (measured; memfit's "
        f"prediction is within {max(worst, 0.1):.1f} MiB of the measurement in every row), batch "
        f"{params['batch']}, width {params['width']}, {report['date_utc'][:10]}, torch "
        f"{report['software']['torch']} on {where}, {machine.get('torch_threads')} threads. "
        f"Step time is the median of {params['repeats']} interleaved runs.",
        "",
        "| blocks | eager peak | `none` | `speed` | `memory` | `checkpoint_sequential` (√n) | "
        "step time `none` / `speed` / `memory` / `checkpoint_sequential` vs eager |",
        "|---:|---:|---:|---:|---:|---:|---|",
    ]
    compared = METHODS[1:]
    for res in results:
        eager = res["methods"].get("eager", {})
        peaks = [
            format_ratio(res["methods"].get(m, {}).get("peak_bytes"), eager.get("peak_bytes"))
            for m in compared
        ]
        times = [
            format_ratio(res["methods"].get(m, {}).get("time_s"), eager.get("time_s"))
            for m in compared
        ]
        eager_peak = f"{eager['peak_bytes'] / MIB:.1f} MiB" if "peak_bytes" in eager else "-"
        lines.append(
            f"| {res['blocks']} | {eager_peak} | " + " | ".join(peaks) + f" | {' / '.join(times)} |"
        )
    return "\n".join(lines)


def replace_block(text: str, block: str, suffix: str = "") -> str:
    """``text`` with what lies between the sweep's markers replaced by ``block``.

    Raises ``ValueError`` if the markers are missing or out of order.
    """
    begin, end = marker(suffix)
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < i:
        raise ValueError(f"no {begin} ... {end} markers in the README")
    return text[: i + len(begin)] + "\n" + block.strip("\n") + "\n" + text[j:]


def update_readme(path: Path, report: dict[str, Any], suffix: str = "") -> bool:
    """Rewrite the README's table from ``report``; False (and nothing written) without markers."""
    text = path.read_text()
    try:
        new = replace_block(text, readme_block(report), suffix)
    except ValueError:
        return False
    if new != text:
        path.write_text(new)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(p, RESULTS)
    p.add_argument(
        "--readme",
        type=Path,
        default=None,
        metavar="PATH",
        help=f"README whose table to rewrite (default {README} for a full sweep, none for --quick)",
    )
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    report = run(args, device)

    readme = args.readme or (None if args.quick else README)
    suffix = "" if device.type == "cpu" else f"_{device.type}"
    if readme is None:
        return 0
    if not readme.is_file():
        print(f"no README at {readme}: its table was not rewritten")
    elif update_readme(readme, report, suffix):
        print(f"rewrote the depth-sweep table in {readme}")
    else:
        begin, end = marker(suffix)
        print(f"{readme} has no {begin} ... {end} markers: its table was not rewritten")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
