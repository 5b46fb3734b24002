"""memfit in ordinary training loops: does the prediction hold for the step the user runs?

Three scenarios, each measured with exact CPU allocator accounting (``memfit.measure``):

* **loss outside**: a language model (2,000-word vocabulary) trained as
  ``cross_entropy(wrapped(x), y)``, three steps per policy: the first step's prediction (made
  before memfit could see the loss) and measurement, then the steps after memfit measured what
  the loss holds and planned again; against ``memfit.step`` with the loss inside, and plain
  PyTorch. Between measured steps the loop runs one unmeasured step, as a training loop does
  (memfit plans again on the step after it measured the loss): on CPU, Inductor's compiled
  graphs are measured while planned only outside a profiler session, so a plan made inside
  ``memfit.measure`` falls back on Inductor's schedule estimate (see the README), and the
  unmeasured step is where a loop plans again.
* **fractions**: ``budget=0.5`` (half the activations plain autograd keeps, plus the rest of
  the step) on the zoo and on small HuggingFace models: feasible or not, predicted and measured.
* **accumulation**: three micro-batches into one ``.grad``: plain against memfit, and memfit
  returning every gradient at once (as it did before it accumulated inside the graph); after
  the measured micro-batches that show memfit the loss, three unmeasured ones (as above).
* **shapes**: one model trained on 12 batch sizes and back to the first ones: every call planned
  (none silently eager), and the plan shown is the shape's that ran.

Writes ``benchmarks/results/training_loops.json`` and ``.md`` naming machine, torch and date
(``--out`` elsewhere). Run: ``.venv/bin/python benchmarks/training_loops.py [--executor
inductor] [--quick]``; with Inductor (``training_loops_inductor.*``) every memfit wrapper
compiles its plans, and its predictions are of what Inductor runs, checked against the same whole
steps. ``--quick`` (``training_loops_quick.*``): each scenario on its smallest cases only (the
loss outside under ``"memory"``, fractions on the zoo's MLP and transformer, accumulation on the
MLP, four batch sizes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

import memfit
from memfit.bench.environment import load_average, machine_info, software_info
from memfit.bench.zoo import ZOO

RESULTS = Path(__file__).resolve().parent / "results"
MiB = 2**20
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hf_models import tiny_hf  # noqa: E402
from lm_models import batch, lm, lm_loss  # noqa: E402


def _peak(fn: Any) -> int:
    return int(memfit.measure(fn).peak_bytes or 0)


def loss_outside(executor: str, quick: bool = False) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    model, (x, y) = lm(), batch()
    lm_loss(model, x, y).backward()
    model.zero_grad(set_to_none=True)
    plain = _peak(lambda: lm_loss(model, x, y).backward())
    model.zero_grad(set_to_none=True)
    rows.append({"how": "plain PyTorch", "policy": "-", "steps": [{"measured": plain}]})
    settings = [("none", "none"), ("memory", "memory"), ("budget=28MiB", "28MiB")]
    for label, policy in settings[1:2] if quick else settings:
        for how in ("memfit.checkpoint, loss outside", "memfit.step, loss inside"):
            torch.compiler.reset()
            if how.startswith("memfit.checkpoint"):
                wrapped = memfit.checkpoint(model, policy, executor=executor)

                def step(wrapped: Any = wrapped) -> None:
                    lm_loss(wrapped, x, y).backward()

                owner: Any = wrapped.memfit
            else:
                if isinstance(model, memfit.CheckpointedModule):
                    memfit.remove(model)  # the step captures the plain model
                train = memfit.step(
                    lambda x, y: lm_loss(model, x, y), policy=policy, executor=executor
                )

                def step(train: Any = train) -> None:
                    train(x, y).backward()

                owner = train
            steps = []
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for i in range(3):
                    if i:  # a step of the loop between measured ones: see the module
                        step()
                        model.zero_grad(set_to_none=True)
                    measured = _peak(step)
                    model.zero_grad(set_to_none=True)
                    plan = owner.plan
                    steps.append(
                        {
                            "measured": measured,
                            "predicted": plan.predicted_peak_bytes,
                            "outside_reserved": plan.outside_bytes,
                            "budget": plan.budget_bytes,
                        }
                    )
            rows.append({"how": how, "policy": label, "steps": steps})
    return rows


def _square_loss(out: Any) -> torch.Tensor:
    """A loss reading every output of a zoo or HuggingFace model."""
    if hasattr(out, "logits"):
        out = out.logits
    elif hasattr(out, "last_hidden_state"):
        out = out.last_hidden_state
    elif isinstance(out, dict):
        out = sum(v.float().sum() for v in out.values())
    elif isinstance(out, (tuple, list)):
        out = sum(v.float().sum() for v in out)
    return out.float().square().mean()


def _hf_case(name: str) -> tuple[str, Any, Any]:
    def make() -> nn.Module:
        torch.manual_seed(0)
        return tiny_hf(name)

    def inputs() -> tuple[tuple[Any, ...], dict[str, Any]]:
        g = torch.Generator().manual_seed(0)
        return (torch.randint(0, 100, (4, 64), generator=g),), {}

    return f"hf-{name}", make, inputs


def _wide_mlp() -> tuple[str, Any, Any]:
    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(1024, 1024), nn.Tanh())])

    def inputs() -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (torch.randn(4, 1024, generator=torch.Generator().manual_seed(0)),), {}

    return "mlp-8x1024", make, inputs


def accumulation(executor: str, quick: bool = False) -> list[dict[str, Any]]:
    """Three micro-batches into the same ``.grad`` (gradient accumulation), the loss outside a
    ``memfit.checkpoint`` wrapper: each micro-batch's peak, plain against memfit, and memfit
    with the backward returning every gradient at once (memfit before it accumulated in the
    graph: ``execution.accumulate`` switched off)."""
    from memfit.execution import runners

    rows = []
    cases = [_wide_mlp()] + [
        (c.name, c.make_model, c.make_inputs) for c in ZOO if c.name in {"resnet", "unet", "gpt2"}
    ]
    cases.append(_hf_case("bert"))
    for name, make_model, make_inputs in cases[:1] if quick else cases:
        model = make_model()
        args, kwargs = make_inputs()

        def micro_batches(
            run: Any,
            model: nn.Module = model,
            args: Any = args,
            kwargs: Any = kwargs,
            measured: bool = True,
        ) -> list[int]:
            model.zero_grad(set_to_none=True)
            go = _peak if measured else lambda fn: fn()
            return [go(lambda: _square_loss(run(*args, **kwargs)).backward()) for _ in range(3)]

        row: dict[str, Any] = {"model": name, "plain": micro_batches(model)}
        for policy in ("none", "memory"):
            torch.compiler.reset()
            wrapped = memfit.checkpoint(model, policy, executor=executor)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                micro_batches(wrapped)  # capture, plan, measure the loss outside
                micro_batches(wrapped, measured=False)  # plan again, unmeasured: see the module
                row[policy] = micro_batches(wrapped)
                original = runners.accumulating
                runners.accumulating = lambda ctx, values: (frozenset(), [])  # type: ignore[assignment]
                try:
                    row[f"{policy} (all gradients at once)"] = micro_batches(wrapped)
                finally:
                    runners.accumulating = original
            row[f"{policy} predicted"] = wrapped.memfit.plan.predicted_peak_bytes
        model.zero_grad(set_to_none=True)
        rows.append(row)
        print(name, row, flush=True)
    return rows


def fractions(executor: str, quick: bool = False) -> list[dict[str, Any]]:
    rows = []
    names = {"transformer", "mlp"} if quick else {"resnet", "transformer", "unet", "mlp", "gpt2"}
    cases: list[tuple[str, Any, Any]] = [
        (c.name, c.make_model, c.make_inputs) for c in ZOO if c.name in names
    ]
    if not quick:
        cases += [_hf_case(name) for name in ("bert", "gpt2", "llama")]
    for name, make_model, make_inputs in cases:
        model = make_model()
        args, kwargs = make_inputs()

        def loss(m: nn.Module, args: Any = args, kwargs: Any = kwargs) -> torch.Tensor:
            return _square_loss(m(*args, **kwargs))

        loss(model).backward()
        model.zero_grad(set_to_none=True)
        plain = _peak(lambda model=model: loss(model).backward())
        model.zero_grad(set_to_none=True)
        row: dict[str, Any] = {"model": name, "plain": plain}
        for label, options in (
            ("none", {"policy": "none"}),
            ("memory", {"policy": "memory"}),
            ("0.5", {"policy": 0.5}),
        ):
            torch.compiler.reset()
            train = memfit.step(
                lambda model=model: loss(model),
                executor=executor,
                **options,  # type: ignore[arg-type]
            )
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    train().backward()
                    model.zero_grad(set_to_none=True)
                    measured = _peak(lambda train=train: train().backward())
                    model.zero_grad(set_to_none=True)
                plan = train.plan
                row[label] = {
                    "measured": measured,
                    "predicted": plan.predicted_peak_bytes,
                    "kept": plan.kept_bytes,
                    "baseline_kept": plan.baseline_kept_bytes,
                    "budget": plan.budget_bytes,
                }
            except memfit.BudgetError as err:
                row[label] = {"error": str(err), "smallest": err.least_bytes}
        rows.append(row)
        print(name, {k: v for k, v in row.items()}, flush=True)
    return rows


def shapes(executor: str, quick: bool = False) -> dict[str, Any]:
    torch.manual_seed(0)
    models = [
        nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(128, 128), nn.Tanh())])
        for _ in range(2)
    ]
    calls = []
    sizes = [16, 32, 48, 16] if quick else [16 * (i + 1) for i in range(12)] + [16, 64, 192]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compiler.reset()
        for index, model in enumerate(models[:1] if quick else models):
            wrapped = memfit.checkpoint(model, "memory", executor=executor)
            for size in sizes:
                x = torch.randn(size, 128)
                if size not in [c["batch"] for c in calls if c["model"] == index]:
                    wrapped(x).sum().backward()  # first call of this shape: capture and plan
                model.zero_grad(set_to_none=True)
                measured = _peak(lambda w=wrapped, x=x: w(x).sum().backward())
                model.zero_grad(set_to_none=True)
                calls.append(
                    {
                        "model": index,
                        "batch": size,
                        "measured": measured,
                        "predicted": wrapped.memfit.plan.predicted_peak_bytes,
                    }
                )
    unplanned = [str(w.message) for w in caught if "plain PyTorch" in str(w.message)]
    return {"calls": calls, "unplanned_warnings": unplanned}


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MiB:.2f}"


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Training loops (benchmarks/training_loops.py)",
        "",
        f"{result['machine'].get('processor', '')}, torch {result['software']['torch']}, "
        f"{result['date']}; memfit's executor: {result.get('executor', 'eager')}; exact CPU "
        "allocator accounting; MiB.",
        "",
        "## A loss outside the model (LM, 2,000-word vocabulary, batch 16 x 64)",
        "",
        "| how | policy | step 1 predicted | step 1 measured | step 2 predicted "
        "| step 2 measured | step 3 measured | outside reserved |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in result["loss_outside"]:
        s = row["steps"]
        if len(s) == 1:
            lines.append(f"| {row['how']} | - | | {_mib(s[0]['measured'])} | | | | |")
            continue
        lines.append(
            f"| {row['how']} | {row['policy']} | {_mib(s[0]['predicted'])} "
            f"| {_mib(s[0]['measured'])} | "
            f"{_mib(s[1]['predicted'])} | {_mib(s[1]['measured'])} | {_mib(s[2]['measured'])} | "
            f"{_mib(s[2]['outside_reserved'])} |"
        )
    lines += [
        "",
        "## budget=0.5 (half of plain autograd's activations plus the rest of the step), "
        "memfit.step",
        "",
        "| model | plain | none measured | memory kept / plain kept | 0.5: budget | predicted "
        "| measured |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in result["fractions"]:
        mem, half, none = row["memory"], row["0.5"], row["none"]
        kept = (
            f"{mem['kept'] / mem['baseline_kept']:.2f}"
            if "kept" in mem and mem["baseline_kept"]
            else "-"
        )
        if "error" in half:
            tail = f"infeasible (smallest {_mib(half['smallest'])}) | | |"
        else:
            tail = (
                f"{_mib(half['budget'])} | {_mib(half['predicted'])} | {_mib(half['measured'])} |"
            )
        lines.append(
            f"| {row['model']} | {_mib(row['plain'])} | {_mib(none.get('measured'))} | {kept} "
            f"| {tail}"
        )
    lines += [
        "",
        "## Gradient accumulation: 3 micro-batches into one .grad, loss outside memfit.checkpoint",
        "",
        "Peak of micro-batch 1 / micro-batches 2-3 (the ones adding into an existing .grad); "
        "'all at once' is memfit with the backward returning every gradient together, as before "
        "it accumulated inside the graph.",
        "",
        "| model | plain | none | none, all at once | memory | memory, all at once "
        "| memory predicted |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def pair(peaks: list[int]) -> str:
        return f"{_mib(peaks[0])} / {_mib(max(peaks[1:]))}"

    for row in result["accumulation"]:
        lines.append(
            f"| {row['model']} | {pair(row['plain'])} | {pair(row['none'])} "
            f"| {pair(row['none (all gradients at once)'])} | {pair(row['memory'])} "
            f"| {pair(row['memory (all gradients at once)'])} "
            f"| {_mib(row['memory predicted'])} |"
        )
    calls = result["shapes"]["calls"]
    worst = max(abs(c["measured"] - c["predicted"]) / c["measured"] for c in calls)
    lines += [
        "",
        "## Shapes",
        "",
        f"{len(calls)} measured calls over {len({c['model'] for c in calls})} model(s) x "
        f"{len({c['batch'] for c in calls})} batch sizes (and back to some of them): "
        f"{len(result['shapes']['unplanned_warnings'])} ran unplanned; the plan shown after "
        f"each call predicted its measured peak within {worst:.1%}.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--executor", choices=("eager", "inductor"), default="eager")
    p.add_argument("--quick", action="store_true", help="each scenario's smallest cases")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    result: dict[str, Any] = {
        "benchmark": "training_loops",
        "executor": args.executor,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "software": software_info(),
        "load_average": load_average(),
        "quick": args.quick,
    }
    result["loss_outside"] = loss_outside(args.executor, args.quick)
    result["fractions"] = fractions(args.executor, args.quick)
    result["accumulation"] = accumulation(args.executor, args.quick)
    result["shapes"] = shapes(args.executor, args.quick)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = (
        "training_loops"
        + ("" if args.executor == "eager" else f"_{args.executor}")
        + ("_quick" if args.quick else "")
    )
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (args.out / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
