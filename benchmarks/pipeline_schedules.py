"""Every pipeline schedule, and ``auto``, through ``memfit.pipeline.Pipeline`` on sleeping blocks.

A 2-core machine cannot show a pipeline's speed-up with real compute (K processes share two
cores), so each block of the model is a ``Linear`` (its input saved for the backward: known
bytes) followed by ``memfit_bench::sleep``, a custom op that sleeps its block's time in the
forward and twice that in the backward (memfit assumes backward = 2 x forward, ``costs.
TRAINING_FACTOR``) and holds no core. memfit captures the op as one opaque node and profiles its
sleep, so the pipeline is cut, planned, placed and run exactly as ``Pipeline`` does for a real
model, on 4 ranks over gloo. The blocks are not equal in time (``BLOCK_UNITS``), so the balance
matters.

Per schedule (the seven of ``PipelineSchedule``) and for the configuration
``memfit.pipeline.plan(..., schedule="auto")`` chooses, one fresh ``Pipeline`` in the same
processes: each rank's predicted peak (``pipe.predicted_step_peak_bytes``) against the one
``memfit.measure`` records over a step, and the step time and bubble predicted
(``timeline.simulate_step`` on the stages' profiled times, with and without the runtime's
measured per-action overhead and the link's latency: NOTE [What a step costs beyond its
stages' times]) against the measured ones (median of ``--repeats`` steps after a warm-up, each
after a barrier, the slowest rank's), beside the formulas: GPipe's ``(K - 1) / (M + K - 1)`` and
the Zero Bubble paper's ZB-H1 ``(K - 1)(F + B - W)`` of idle per rank (B and W the backward's
input and weight halves), which memfit's zero-bubble schedules do not reach: memfit runs the
backward in one piece (NOTE [Zero-bubble schedules and memfit's one-piece backward] in
``pipeline/runtime.py``), so their bubble is 1F1B's. The baseline is torchgpipe's: the same
blocks in equal numbers per stage, eager, GPipe, no balancing.

The overhead is measured on the same model with blocks that sleep nothing, one micro-batch under
GPipe (one rank works at a time: each action's own cost, not four ranks' contention for two
cores), timed before every configuration and pooled into one number as the machine's load
drifts; the latency by a ping-pong between two ranks at the same moments. Both go into every
row's prediction. Once before ``auto`` chooses, the same probe and ping-pong give the overhead
and latency passed to ``plan(..., overhead=, latency=)``, as a user would measure them first:
``auto`` weighs what each action costs, and its plan's ``step_seconds`` is set against the step
measured. A second pass plans every schedule, and ``auto``, under a per-device budget
of ``--budget-fraction`` (0.75) of the schedules' median largest rank peak: some are refused,
some recompute. Writes ``benchmarks/results/pipeline_schedules.{json,md}`` (``--quick``: two
steps each, no budget pass unless ``--budget-fraction`` is given, ``_quick`` files).

The units stay at 5 ms in ``--quick``: with shorter ones the runtime's own work (about 2 ms an
action here) rivals the stages', and four ranks' worth of it contends for two cores, which the
simulation does not model (2 ms units measured up to 38% above it where M = 16 doubles the
actions).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

import memfit
from memfit.pipeline import Pipeline, PipelineOptions, launch
from memfit.pipeline.schedule import SCHEDULES, check_schedule, default_stages_per_rank
from memfit.pipeline.timeline import simulate_step
from pipeline_schedule import write_record

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
RANKS = 4
MICROBATCHES = 8
#: activations, not parameters, fill memory (as in issue 57's MLP): 32 KiB per micro-batch's
#: activation at M = 8, 16 KiB of weights per block
WIDTH = 64
BATCH = 1024
#: each block's forward in units of ``--unit`` ms: later blocks slower, as a deep net's head
BLOCK_UNITS = [1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]


@torch.library.custom_op("memfit_bench::sleep", mutates_args=())
def sleep(x: torch.Tensor, seconds: float) -> torch.Tensor:
    """``x`` again, ``seconds`` per ``BATCH // MICROBATCHES`` rows later (as compute grows with
    the micro-batch, so that fewer, larger micro-batches are not free); no core held."""
    if seconds > 0:
        time.sleep(seconds * x.shape[0] / (BATCH // MICROBATCHES))
    return x.clone()


@sleep.register_fake
def _(x: torch.Tensor, seconds: float) -> torch.Tensor:
    return torch.empty_like(x)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.seconds = inputs[1]


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return sleep(grad, 2 * ctx.seconds), None


sleep.register_autograd(_backward, setup_context=_setup)


class Block(nn.Module):
    """A ``Linear`` then a sleep of ``seconds`` (twice that in the backward)."""

    def __init__(self, width: int, seconds: float) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sleep(self.linear(x), self.seconds)


def build(unit_s: float) -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    """The model (same parameters on every rank), a mini-batch and its target."""
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(WIDTH, u * unit_s) for u in BLOCK_UNITS))
    return model, torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def _timed(step: Any, params: list[nn.Parameter], repeats: int) -> tuple[list[float], int]:
    """A warm-up step, one step under ``memfit.measure`` (its peak), then ``repeats`` timed
    steps, each after a barrier, gradients cleared before each (as the prediction assumes)."""

    def clear() -> None:
        for p in params:
            p.grad = None

    clear()
    step()
    clear()
    dist.barrier()
    peak = memfit.measure(step).peak_bytes or 0
    times = []
    for _ in range(repeats):
        clear()
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times, peak


def _pipeline(
    unit_s: float, job: dict[str, Any], budget: int | None
) -> tuple[Pipeline, torch.Tensor, torch.Tensor] | str:
    """A fresh ``Pipeline`` of the model for ``job``, with its batch and target, or why it was
    refused."""
    torch.compiler.reset()  # a fresh capture per pipeline: Dynamo limits recompiles
    model, x, target = build(unit_s)
    try:
        pipe = Pipeline(
            model,
            x,
            loss_fn,
            ranks=RANKS,
            options=PipelineOptions(
                microbatches=job["microbatches"],
                schedule=job["schedule"],
                stages_per_rank=job["stages_per_rank"],
                budget=budget,
            ),
            release_others=False,
        )
    except (ValueError, memfit.BudgetError) as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return pipe, x, target


def _measured(built: tuple[Pipeline, torch.Tensor, torch.Tensor] | str, repeats: int) -> dict:
    """This rank's prediction and measurements of a pipeline (``_timed``)."""
    if isinstance(built, str):
        return {"refused": built}
    pipe, x, target = built
    times, peak = _timed(lambda: pipe.step(x, target=target), list(pipe.parameters()), repeats)
    return {
        "plans": pipe.plans,
        "predicted_peak": pipe.predicted_step_peak_bytes,
        "held": sum(p.held_bytes for p in pipe.plans),
        "measured_peak": peak,
        "times": times,
        "recompute_s": sum(p.recompute_seconds for p in pipe.plans),
    }


def _pipeline_job(
    rank: int, unit_s: float, job: dict[str, Any], repeats: int, budget: int | None
) -> dict[str, Any]:
    return _measured(_pipeline(unit_s, job, budget), repeats)


def _uniform_job(rank: int, unit_s: float, microbatches: int, repeats: int) -> dict[str, Any]:
    """torchgpipe's split: equal numbers of blocks per stage, eager, GPipe."""
    model, x, target = build(unit_s)
    per = len(BLOCK_UNITS) // RANKS
    stage_module = nn.Sequential(*list(model)[rank * per : (rank + 1) * per])
    micro = torch.zeros(BATCH // microbatches, WIDTH)
    stage = PipelineStage(
        stage_module,
        rank,
        RANKS,
        torch.device("cpu"),
        input_args=(micro.clone().requires_grad_(rank > 0),),
        output_args=(micro.clone().requires_grad_(),),
    )
    sched = ScheduleGPipe(stage, microbatches, loss_fn=loss_fn, scale_grads=True)

    def step() -> None:
        if rank == 0:
            sched.step(x, return_outputs=False)
        elif rank == RANKS - 1:
            sched.step(target=target, losses=[], return_outputs=False)
        else:
            sched.step(return_outputs=False)

    times, peak = _timed(step, list(stage_module.parameters()), repeats)
    return {"measured_peak": peak, "times": times}


def _latency(rank: int, rounds: int = 40) -> list[float]:
    """Half round trips of one micro-batch's activation between ranks 0 and 1 (after a few
    unrecorded), on rank 0; nothing elsewhere."""
    buf = torch.zeros(BATCH // MICROBATCHES, WIDTH)
    halves = []
    dist.barrier()
    for _ in range(rounds):
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        halves.append((time.perf_counter() - start) / 2)
    return halves[5:] if rank == 0 else []


def _auto_choice(
    unit_s: float, budget: int | None, overhead: float, latency: float
) -> dict[str, Any] | None:
    """What ``memfit.pipeline.plan(..., schedule="auto")`` chooses, weighing the per-action
    ``overhead`` and the ``latency`` measured before it (``_measured_costs``), with its own
    predicted step; or why it chose nothing (refused, or not there yet)."""
    from memfit.pipeline import plan

    model, x, _ = build(unit_s)
    try:
        chosen = plan(
            model,
            x,
            loss_fn,
            ranks=RANKS,
            options=PipelineOptions(
                schedule="auto",  # microbatches left out: auto chooses
                budget=budget,
                overhead=overhead,
                latency=latency,
            ),
        )
    except Exception as exc:  # a BudgetError, or an API older than "auto": say why
        return {"unavailable": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
    return {
        "schedule": str(chosen.schedule),
        "stages_per_rank": chosen.stages_per_rank,
        "microbatches": chosen.microbatches,
        "plan_step_s": chosen.step_seconds,
        "plan_bubble": chosen.bubble,
        "overhead_s": overhead,
        "latency_s": latency,
        "table": str(chosen),
    }


def _with_auto(jobs: list[dict[str, Any]], auto: dict[str, Any] | None) -> list[dict[str, Any]]:
    """``jobs``, and the configuration ``auto`` chose where it chose one."""
    if auto is None or "schedule" not in auto:
        return list(jobs)
    return [*jobs, {**auto, "name": "auto"}]


def _agreed_auto(
    rank: int, unit_s: float, budget: int | None, costs: tuple[float, float]
) -> dict[str, Any] | None:
    """Rank 0's ``auto`` choice on every rank (timings differ between ranks); ``costs``: the
    overhead and latency ``auto`` weighs."""
    auto: list[Any] = [_auto_choice(unit_s, budget, *costs) if rank == 0 else None]
    dist.broadcast_object_list(auto, src=0)
    return auto[0]


def _measured_costs(
    rank: int, zero: tuple[Pipeline, torch.Tensor, torch.Tensor]
) -> tuple[float, float]:
    """The per-action overhead and the latency, measured before ``auto`` chooses (as a user
    would before calling ``plan``): 15 steps of the zero-time pipeline and a ping-pong, solved
    as for the table (``_solve_overhead``) from every rank's stages and steps; the same on
    every rank."""
    probe = _probe(zero, repeats=15)
    trips = _latency(rank)
    gathered: list[Any] = [None] * RANKS
    dist.all_gather_object(gathered, {"plans": zero[0].plans, "probes": [probe], "trips": trips})
    latency = statistics.median(gathered[0]["trips"])
    overhead, _ = _solve_overhead(gathered, latency)
    return overhead, latency


def _rank(
    rank: int, unit_s: float, jobs: list[dict[str, Any]], repeats: int, fraction: float | None
) -> dict[str, Any]:
    # four ranks on two cores: torch's intra-op threads would spin against each other
    # (a 64-wide Linear took 8 ms with two threads under load, 40 us with one)
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    # One micro-batch through stages that take no time: one rank works at a time, so what is
    # timed is each action's own cost, not four ranks' contention for two cores. Timed once
    # before auto chooses (what it weighs), then before every configuration (the machine's load
    # drifts), the latter pooled into the table's overhead.
    zero = _pipeline(0.0, {"schedule": "gpipe", "stages_per_rank": 1, "microbatches": 1}, None)
    assert not isinstance(zero, str), zero
    costs = _measured_costs(rank, zero)
    out["auto_costs"] = costs
    out["auto"] = _agreed_auto(rank, unit_s, None, costs)
    runs = _with_auto(jobs, out["auto"])
    probes: list[list[float]] = []
    trips: list[float] = []

    def probed(run: Any) -> Any:
        probes.append(_probe(zero))
        trips.extend(_latency(rank))
        return run()

    out["uniform"] = probed(lambda: _uniform_job(rank, unit_s, MICROBATCHES, repeats))
    out["jobs"] = {
        job["name"]: probed(lambda job=job: _pipeline_job(rank, unit_s, job, repeats, None))
        for job in runs
    }
    if fraction is not None:
        peaks = [
            [r["held"] + r["predicted_peak"]] if "plans" in r else [] for r in out["jobs"].values()
        ]
        gathered: list[Any] = [None] * RANKS
        dist.all_gather_object(gathered, peaks)
        largest = [max(p for g in gathered for p in g[i]) for i in range(len(peaks)) if peaks[i]]
        budget = int(fraction * statistics.median(largest))
        out["budget"] = budget
        out["auto_budgeted"] = _agreed_auto(rank, unit_s, budget, costs)
        out["budgeted"] = {
            job["name"]: probed(lambda job=job: _pipeline_job(rank, unit_s, job, repeats, budget))
            for job in _with_auto(jobs, out["auto_budgeted"])
        }
    out["zero"] = {"plans": zero[0].plans, "probes": probes}
    out["latency_s"] = trips
    return out


def _probe(built: tuple[Pipeline, torch.Tensor, torch.Tensor], repeats: int = 5) -> list[float]:
    """``repeats`` timed steps of the zero-time pipeline after a warm-up, each after a barrier."""
    pipe, x, target = built
    pipe.step(x, target=target)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        pipe.step(x, target=target)
        times.append(time.perf_counter() - start)
    return times


def _solve_overhead(zero: list[dict[str, Any]], latency: float) -> tuple[float, list[float]]:
    """The per-action overhead that makes the simulated step of one micro-batch through the
    zero-time stages (GPipe: 2K actions one after another) the measured one: from the median of
    every probe's steps, and from each probe's alone (the spread)."""
    stages = sorted((p for r in zero for p in r["plans"]), key=lambda p: p.index)
    forward = [p.forward_seconds for p in stages]
    backward = [p.time_seconds - p.forward_seconds for p in stages]
    bare, _ = simulate_step("gpipe", RANKS, 1, 1, forward, backward, latency=latency)
    probes = [
        [max(r["probes"][i][j] for r in zero) for j in range(len(zero[0]["probes"][i]))]
        for i in range(len(zero[0]["probes"]))
    ]

    def solve(steps: list[float]) -> float:
        return max(0.0, (statistics.median(steps) - bare) / (2 * RANKS))

    return solve([t for p in probes for t in p]), [solve(p) for p in probes]


def _row(
    name: str, job: dict[str, Any], per_rank: list[dict[str, Any]], overhead: float, latency: float
) -> dict[str, Any]:
    schedule, v, m = job["schedule"], job["stages_per_rank"], job["microbatches"]
    row: dict[str, Any] = {
        "name": name,
        "schedule": schedule,
        "stages_per_rank": v,
        "microbatches": m,
    }
    if any("refused" in r for r in per_rank):
        row["refused"] = next(r["refused"] for r in per_rank if "refused" in r)
        return row
    stages = sorted((p for r in per_rank for p in r["plans"]), key=lambda p: p.index)
    forward = [p.forward_seconds for p in stages]
    backward = [p.time_seconds - p.forward_seconds for p in stages]
    bare, _ = simulate_step(schedule, RANKS, v, m, forward, backward)
    predicted, bubble = simulate_step(
        schedule, RANKS, v, m, forward, backward, overhead=overhead, latency=latency
    )
    steps = [max(r["times"][i] for r in per_rank) for i in range(len(per_rank[0]["times"]))]
    measured = statistics.median(steps)
    busy = m * (sum(forward) + sum(backward))
    rank_f = sum(forward) / RANKS
    rank_b = sum(backward) / RANKS
    # the Zero Bubble paper's idle per rank: 1F1B (K-1)(F+B+W), ZB-H1 (K-1)(F+B-W), B = W here
    zb_idle = (RANKS - 1) * rank_f
    row.update(
        {
            "first_modules": [p.first_module for p in stages],
            "stage_seconds": [p.time_seconds for p in stages],
            "predicted_peaks": [r["predicted_peak"] for r in per_rank],
            "measured_peaks": [r["measured_peak"] for r in per_rank],
            "held_bytes": [r["held"] for r in per_rank],
            "recompute_s": sum(r["recompute_s"] for r in per_rank),
            "measured_s": measured,
            "steps_s": steps,
            "predicted_bare_s": bare,
            "predicted_s": predicted,
            "ratio": measured / predicted,
            "bubble_measured": max(0.0, 1 - busy / (RANKS * measured)),
            "bubble_predicted": bubble,
            "bubble_gpipe_formula": (RANKS - 1) / (m + RANKS - 1),
            "bubble_zb_h1_formula": zb_idle / (zb_idle + m * (rank_f + rank_b)),
        }
    )
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 steps each, no budget pass")
    parser.add_argument("--unit", type=float, default=5.0, help="ms per block unit")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--budget-fraction", type=float, default=None, help="0.75; quick: none")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    unit = args.unit
    repeats = args.repeats if args.repeats is not None else (2 if args.quick else 5)
    fraction = args.budget_fraction
    if fraction is None and not args.quick:
        fraction = 0.75
    jobs = []
    for schedule in SCHEDULES:
        v = default_stages_per_rank(schedule)
        check_schedule(schedule, RANKS, MICROBATCHES, v)
        jobs.append(
            {
                "name": schedule,
                "schedule": schedule,
                "stages_per_rank": v,
                "microbatches": MICROBATCHES,
            }
        )
    started = time.perf_counter()
    per_rank = launch(
        _rank,
        RANKS,
        args=(unit / 1e3, jobs, repeats, fraction),
        timeout=3600,
    )
    latency = statistics.median(per_rank[0]["latency_s"])
    overhead, overheads = _solve_overhead([r["zero"] for r in per_rank], latency)
    auto = per_rank[0]["auto"]
    runs = _with_auto(jobs, auto)
    rows = [
        _row(j["name"], j, [r["jobs"][j["name"]] for r in per_rank], overhead, latency)
        for j in runs
    ]
    budget = per_rank[0].get("budget")
    budgeted = (
        [
            _row(j["name"], j, [r["budgeted"][j["name"]] for r in per_rank], overhead, latency)
            for j in _with_auto(jobs, per_rank[0].get("auto_budgeted"))
        ]
        if budget is not None
        else []
    )
    uniform = [r["uniform"] for r in per_rank]
    uniform_steps = [max(r["times"][i] for r in uniform) for i in range(repeats)]
    units = [u * unit / 1e3 for u in BLOCK_UNITS]
    per = len(units) // RANKS
    stage_f = [sum(units[r * per : (r + 1) * per]) for r in range(RANKS)]
    uniform_predicted, _ = simulate_step(
        "gpipe",
        RANKS,
        1,
        MICROBATCHES,
        stage_f,
        [2 * f for f in stage_f],
        overhead=overhead,
        latency=latency,
    )
    uniform_row = {
        "name": "uniform split (torchgpipe)",
        "schedule": "gpipe",
        "measured_s": statistics.median(uniform_steps),
        "steps_s": uniform_steps,
        "predicted_s": uniform_predicted,
        "measured_peaks": [r["measured_peak"] for r in uniform],
        "bubble_measured": max(
            0.0, 1 - MICROBATCHES * 3 * sum(units) / (RANKS * statistics.median(uniform_steps))
        ),
    }
    record_rows = {
        "unit_ms": unit,
        "block_units": BLOCK_UNITS,
        "ranks": RANKS,
        "latency_s": latency,
        "overhead_s": overhead,
        "overheads_s": overheads,
        "auto_overhead_s": per_rank[0]["auto_costs"][0],
        "auto_latency_s": per_rank[0]["auto_costs"][1],
        "auto": auto,
        "auto_budgeted": per_rank[0].get("auto_budgeted"),
        "budget_bytes": budget,
        "budget_fraction": fraction,
        "rows": rows,
        "budgeted": budgeted,
        "uniform": uniform_row,
    }
    result = write_record("pipeline_schedules", [record_rows], started, args.out, args.quick)
    lines = _markdown(result, record_rows, repeats)
    stem = "pipeline_schedules_quick" if args.quick else "pipeline_schedules"
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))  # noqa: T201
    return 0


def _kib(n: int) -> str:
    return f"{n / 1024:.0f}"


def _table(rows: list[dict[str, Any]], budgeted: bool) -> list[str]:
    head = (
        "| schedule | V | M | step measured s | predicted s | ratio | bubble measured | "
        "predicted | (K-1)/(M+K-1) | ZB-H1 | rank peaks measured / predicted KiB | worst peak |"
    )
    if budgeted:
        head += " recompute |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if "refused" in r:
            lines.append(
                f"| {r['name']} | {r['stages_per_rank']} | {r['microbatches']} | "
                f"refused: {r['refused'][:110]} |"
            )
            continue
        peaks = ", ".join(
            f"{_kib(m)}/{_kib(p)}" for m, p in zip(r["measured_peaks"], r["predicted_peaks"])
        )
        worst = max(abs(m / p - 1) for m, p in zip(r["measured_peaks"], r["predicted_peaks"]) if p)
        name = r["name"] if r["name"] != "auto" else f"auto: {r['schedule']}"
        line = (
            f"| {name} | {r['stages_per_rank']} | {r['microbatches']} | {r['measured_s']:.3f} | "
            f"{r['predicted_s']:.3f} | {r['ratio']:.3f} | {r['bubble_measured']:.1%} | "
            f"{r['bubble_predicted']:.1%} | {r['bubble_gpipe_formula']:.1%} | "
            f"{r['bubble_zb_h1_formula']:.1%} | {peaks} | {worst:.1%} |"
        )
        if budgeted:
            line += f" {r['recompute_s'] * 1e3:.1f} ms |"
        lines.append(line)
    return lines


def _markdown(result: dict[str, Any], rec: dict[str, Any], repeats: int) -> list[str]:
    units = "/".join(str(u) for u in rec["block_units"])
    lines = [
        "# Every schedule through memfit.pipeline.Pipeline, sleeping blocks (4 ranks, gloo)",
        "",
        f"{result['date']}, torch {result['software']['torch']}, "
        f"{result['machine'].get('cpu_model', '?')}; {len(rec['block_units'])} blocks "
        f"(Linear {WIDTH} wide, then a sleep of {units} x {rec['unit_ms']:g} ms forward, twice "
        f"that backward), batch {BATCH}; median of {repeats} steps, the slowest rank's. "
        f"Measured per action: overhead {rec['overhead_s'] * 1e3:.2f} ms (one micro-batch through "
        f"zero-time stages, timed before each configuration: "
        f"{min(rec['overheads_s']) * 1e3:.2f}-{max(rec['overheads_s']) * 1e3:.2f} ms each), "
        f"latency {rec['latency_s'] * 1e3:.3f} ms (ping-pong between two ranks, also before each "
        "configuration); both are in 'predicted'. Measured once before `auto` chose (15 steps "
        f"of the same, a ping-pong) and passed to `plan(..., overhead=, latency=)`: overhead "
        f"{rec['auto_overhead_s'] * 1e3:.2f} ms, latency {rec['auto_latency_s'] * 1e3:.3f} ms.",
        "",
        "Rank peaks are above what is live before a step (`Pipeline.predicted_step_peak_bytes` "
        "against `memfit.measure`). ZB-H1 is the Zero Bubble paper's idle per rank, "
        "(K-1)(F+B-W) with the backward's input and weight halves B = W: memfit runs the "
        "backward in one piece, so its zero-bubble schedules get 1F1B-like bubbles, not that.",
        "",
        *_table(rec["rows"], False),
    ]
    worst = max(abs(r["ratio"] - 1) for r in rec["rows"] if "ratio" in r)
    bare = max(
        abs(r["measured_s"] / r["predicted_bare_s"] - 1) for r in rec["rows"] if "ratio" in r
    )
    lines += [
        "",
        f"Largest deviation of measured from predicted step: {worst:.1%} "
        f"({bare:.1%} from the stages' times alone, without overhead and latency).",
    ]
    lines += _auto_summary(rec)
    if rec["auto"] is not None:
        if "table" in rec["auto"]:
            lines += ["", '`schedule="auto"` compared:', "", "```", rec["auto"]["table"], "```"]
        else:
            lines += ["", f'`schedule="auto"`: not run ({rec["auto"]["unavailable"]}).']
    u = rec["uniform"]
    gpipe = next(r for r in rec["rows"] if r["name"] == "gpipe")
    lines += [
        "",
        "Against torchgpipe's uniform split (4 blocks per stage, eager, GPipe, no balancing):",
        "",
        "| split | step measured s | predicted s | bubble measured | rank peaks measured KiB |",
        "|---|---:|---:|---:|---|",
        f"| uniform | {u['measured_s']:.3f} | {u['predicted_s']:.3f} | "
        f"{u['bubble_measured']:.1%} | "
        f"{', '.join(_kib(p) for p in u['measured_peaks'])} |",
        f"| memfit (stages from {', '.join(gpipe['first_modules'])}) | {gpipe['measured_s']:.3f} | "
        f"{gpipe['predicted_s']:.3f} | {gpipe['bubble_measured']:.1%} | "
        f"{', '.join(_kib(p) for p in gpipe['measured_peaks'])} |",
    ]
    if rec["budget_bytes"] is not None:
        lines += [
            "",
            f"Under a per-device budget of {_kib(rec['budget_bytes'])} KiB "
            f"({rec['budget_fraction']:.0%} of the schedules' median largest rank peak without "
            "one; the budget holds state and buffers too, the table's peaks are above them):",
            "",
            *_table(rec["budgeted"], True),
        ]
        auto = rec.get("auto_budgeted")
        if auto is not None and "table" in auto:
            lines += ["", '`schedule="auto"` under it compared:', "", "```", auto["table"], "```"]
        elif auto is not None:
            lines += ["", f'`schedule="auto"` under it: {auto["unavailable"]}.']
    return lines


def _auto_summary(rec: dict[str, Any]) -> list[str]:
    """``auto``'s choices: the step its plan predicts (``PipelinePlan.step_seconds``, with the
    overhead and latency measured before it) against the measured one, beside the fastest
    measured configuration of the same pass."""
    passes = [("none", rec["auto"], rec["rows"])]
    if rec["budget_bytes"] is not None:
        passes.append((f"{_kib(rec['budget_bytes'])} KiB", rec["auto_budgeted"], rec["budgeted"]))
    lines = [
        "",
        "`auto`'s choice: its plan's step (`PipelinePlan.step_seconds`, with the overhead and "
        "latency measured before it) against the measured step, and the fastest measured "
        "configuration under the same budget:",
        "",
        "| budget | auto chose | V | M | plan's step s | measured s | ratio | fastest measured |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for budget, auto, rows in passes:
        run = next((r for r in rows if r["name"] == "auto" and "measured_s" in r), None)
        if auto is None or "plan_step_s" not in auto or run is None:
            why = (auto or {}).get("unavailable", "not run")
            lines.append(f"| {budget} | {why} |")
            continue
        best = min((r for r in rows if "measured_s" in r), key=lambda r: r["measured_s"])
        name = best["name"] if best["name"] != "auto" else "auto's choice"
        lines.append(
            f"| {budget} | {auto['schedule']} | {auto['stages_per_rank']} | "
            f"{auto['microbatches']} | {auto['plan_step_s']:.3f} | {run['measured_s']:.3f} | "
            f"{run['measured_s'] / auto['plan_step_s']:.3f} | {name} (V = "
            f"{best['stages_per_rank']}, M = {best['microbatches']}), {best['measured_s']:.3f} s |"
        )
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
