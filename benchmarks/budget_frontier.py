"""Budget frontier: memfit's memory/time trade-off against the two ways PyTorch offers one.

Why: a memory budget is only worth having if, at the memory it reaches, the step is at least as
fast as what a user gets from PyTorch alone. PyTorch offers two knobs for the same trade-off:

* ``torch.compile`` with ``torch._functorch.config.activation_memory_budget = b`` (Inductor's
  min-cut partitioner solves a knapsack to save at most a fraction ``b`` of the activations its
  default, runtime-optimised partition saves; 1.0 is plain ``torch.compile``);
* eager ``torch.utils.checkpoint.checkpoint_sequential(seq, segments, x, use_reentrant=False)``
  for every segment count (it checkpoints all segments but the last, so ``segments=1`` is plain
  eager); it needs the model's layers as one ``nn.Sequential``.

This script puts memfit's frontier next to both, per model: ``memfit.checkpoint(model, f)`` for
budget fractions ``f`` of plain autograd's activation peak (a budget below the smallest feasible
raises ``memfit.BudgetError``; that is recorded, and memfit is then also run at exactly its
``least_bytes``), and memfit's modes ``"none"``, ``"speed"`` and ``"memory"``. Plain eager is
the reference every ratio is taken against.

Models (from the zoo the tests train, ``memfit.bench.zoo``, sized up so one CPU step takes about
0.1-0.2 s):

* ``resnet``       ``zoo.cifar_resnet`` (pre-activation CIFAR ResNet, BatchNorm); its residual
                   blocks are ``model.blocks``, the sequence ``checkpoint_sequential`` splits;
* ``transformer``  ``zoo.Encoder`` (``nn.TransformerEncoder``); every peer trains
                   ``memfit.bench.peers.SequentialEncoder``, the same layers held in one
                   ``nn.Sequential`` (what ``TransformerEncoder.forward`` computes without mask
                   or final norm), so that ``checkpoint_sequential`` applies;
* ``unet``         ``zoo.unet``: encoder features are concatenated into the decoder, so the model
                   is not a sequence and ``checkpoint_sequential`` does not apply (recorded N/A).

How (one process, one measurement per point): a point is one peer at one setting, on its own
freshly seeded copy of the model (identical weights everywhere). Each point is entered through its
own module class whose ``forward`` is a distinct code object (``memfit.bench.peers.entry_point``),
so Dynamo keeps every point's compiled code apart: no point reuses another's graph, none counts
against another's recompile limit, and all stay compiled while their timed steps are interleaved.
(The alternative, ``torch.compiler.reset()`` between points, discards the earlier points' compiled
code, which would then be recompiled on their next call under whatever budget is set at that
moment.) Dynamo is reset once per model, and the number of graphs compiled during measurement is
recorded (0 expected). A ``torch.compile`` point is compiled inside
``torch._functorch.config.patch(activation_memory_budget=b)`` spanning its whole first step
(forward and the lazily compiled backward).

Per point, measured by ``memfit.bench.runner`` as the depth sweep and the CLI measure theirs: two
warm-up steps (the first timed as ``first_step_s``: compilation, capture and planning), then one
step under ``memfit.measure`` for the peak (exact CPU allocator accounting, deterministic), then
``--rounds`` rounds of turns, round-robin over all the model's points with the starting point
rotated each round, so machine noise hits every peer alike. A turn is ``--settle`` untimed steps
(default 1) and then ``--steps-per-turn`` steps (default 2) timed by ``memfit.measure(...,
profile_memory=False)`` (no profiler): a point's timed steps run as a training loop runs them,
one after another of the same program, not on the memory another point's step left
(``memfit.bench.runner`` says what that changed). Garbage is collected before each step, outside
the timed span, and automatic collection is off during a round, so no collection lands inside a
timed step. The median is reported, with quartiles, min and max, and the median of the minor page
faults the process took during each timed step. Each step is
``loss(module(*inputs)).backward()`` with the zoo case's loss; gradients are set to ``None``
before every step, as ``optimizer.zero_grad()`` does.

Recomputed FLOPs, per peer (``recompute_flops_method`` in the JSON says which):

* memfit: ``plan.recompute_flops`` (``torch.utils.flop_counter`` formulas for matmul, convolution
  and attention, plus one FLOP per output element of every other recomputed op);
* ``checkpoint_sequential``: ``FlopCounterMode`` total of one step minus that of plain eager;
* ``torch.compile``: the same formulas summed over the forward and backward graphs Inductor
  compiles (read in a ``post_grad_custom_post_pass``) minus plain eager's ``FlopCounterMode``
  total. ``FlopCounterMode`` cannot count a compiled step itself: under a ``TorchDispatchMode``
  Dynamo runs the frame eagerly. (A plain-callable custom pass also makes Inductor bypass its FX
  graph cache, so every ``torch.compile`` point really compiles.)

The peers' counts cover matmul, convolution and attention only (``FlopCounterMode``'s table, to
which this script adds the CPU flash-attention kernels it lacks), so memfit's figure is higher by
its elementwise share.

Outputs (``_quick`` suffix for ``--quick``) in ``benchmarks/results/``:
``budget_frontier.json`` (machine, versions, parameters, every point), ``budget_frontier.md``
(per model: every point, memfit against the fastest peer point at equal measured peak, and an
A/A check: settings of one peer that ran one program, compared with each other the same way) and
``budget_frontier_<model>.png`` (measured peak against step time, the Pareto front).

Run with the Python of the environment memfit is installed in (``pip install -e .``; the
Makefile's ``.venv``): ``python benchmarks/budget_frontier.py [--quick] [--models resnet unet]``.
``--device cuda`` runs every point on the GPU (peaks from the caching allocator's statistics,
steps synchronised around each timing; outputs get ``_cuda``); ``--batch-scale N`` multiplies
every model's batch (the CPU sizes leave a GPU step bound by kernel launches), and
``--compile-budgets`` / ``--memfit-budgets`` pick fewer points where time on the device is short
(outputs then get ``_batch<N>x`` and ``_points``, so the full results are never overwritten),
as does ``--memfit-modes``; ``--timing-lock FILE`` lets runs of one model each, started in
parallel on one machine, compile at once and time one at a time once none is compiling
(``memfit.bench.timing_lock``), since on a lent GPU compiling takes most of the time.
The full run takes 10-20 minutes on 2 CPU cores (about half of it Inductor compiling 30 points);
``--quick`` (tiny models, one ``torch.compile`` budget, two memfit budgets, 3 rounds) about 50 s.
"""

from __future__ import annotations

import os

# Set before torch loads OpenMP: with active waiting, OpenMP threads spin at every barrier and a
# step on a shared 2-core machine can take 40x longer (see memfit.bench.depth_sweep).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import datetime as dt  # noqa: E402
import hashlib  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from contextlib import ExitStack, nullcontext  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.fx as fx  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode, flop_registry  # noqa: E402

import memfit  # noqa: E402
from memfit._compat import (  # noqa: E402
    activation_memory_budget,
    inductor_post_grad_pass,
    tree_map_only,
    unique_graph_count,
)
from memfit.bench import zoo  # noqa: E402
from memfit.bench.environment import load_average, machine_info, software_info  # noqa: E402
from memfit.bench.peers import SequentialCheckpointed, SequentialEncoder, entry_point  # noqa: E402
from memfit.bench.runner import (  # noqa: E402
    FIRST_STEP,
    Method,
    Snapshot,
    attempt,
    first_step,
    measure_peaks,
    plan_record,
    time_interleaved,
)
from memfit.bench.timing_lock import TimingLock  # noqa: E402
from memfit.units import MIB  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CPU = torch.device("cpu")

__all__ = ["main", "MODELS"]

#: ``activation_memory_budget`` values for the ``torch.compile`` peer.
COMPILE_BUDGETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
#: memfit budgets, as fractions of plain autograd's activation peak.
MEMFIT_BUDGETS = (1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.25, 0.2, 0.15, 0.1)
MEMFIT_MODES = ("none", "speed", "memory")
QUICK_COMPILE_BUDGETS = (0.5,)
QUICK_MEMFIT_BUDGETS = (0.5, 0.05)
#: A peer point counts as "at equal peak" with a memfit point if it peaks at most this much higher.
PEAK_TOLERANCE = 1.05
PEERS = ("eager", "checkpoint_sequential", "torch.compile", "memfit")

aten = torch.ops.aten

# ------------------------------------------------------------------------------------- models


@dataclass
class ModelSpec:
    """One benchmarked model: how to build it, its inputs and loss, and what it is."""

    name: str
    description: str
    build: Callable[[], nn.Module]  # seeded: every call gives identical weights, on ``device``
    inputs: tuple[torch.Tensor, ...]
    loss: Callable[[Any], torch.Tensor]
    config: dict[str, Any]
    sequence_length: int | None  # len(model.blocks); None: checkpoint_sequential does not apply
    not_sequential_reason: str | None = None
    device: torch.device = CPU


def _zoo_loss(name: str) -> Callable[[Any], torch.Tensor]:
    return next(c for c in zoo.ZOO if c.name == name).loss


def model_specs(quick: bool, device: torch.device = CPU, batch_scale: int = 1) -> list[ModelSpec]:
    if quick:
        r = dict(blocks_per_stage=1, width=8, batch=8)
        t = dict(d_model=32, nhead=4, num_layers=3, batch=4, seq=32)
        u = dict(depth=2, width=4, batch=2, size=32)
    else:
        r = dict(blocks_per_stage=4, width=16, batch=32)
        t = dict(d_model=128, nhead=4, num_layers=8, batch=8, seq=128)
        u = dict(depth=3, width=8, batch=8, size=128)
    for config in (r, t, u):
        config["batch"] *= batch_scale

    def on_device(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
        return lambda: build().to(device)

    specs = [
        ModelSpec(
            name="resnet",
            description=(
                f"zoo.cifar_resnet({r['blocks_per_stage']}, width={r['width']}): "
                f"{3 * r['blocks_per_stage']} pre-activation residual blocks with "
                f"BatchNorm, batch {r['batch']}x3x32x32, cross-entropy"
            ),
            build=on_device(
                zoo.seeded(lambda: zoo.cifar_resnet(r["blocks_per_stage"], r["width"]))
            ),
            inputs=(zoo.randn(r["batch"], 3, 32, 32).to(device),),
            loss=_zoo_loss("resnet"),
            config=r,
            sequence_length=3 * r["blocks_per_stage"],
        ),
        ModelSpec(
            name="transformer",
            description=(
                f"zoo.Encoder(d_model={t['d_model']}, nhead={t['nhead']}, "
                f"num_layers={t['num_layers']}) as SequentialEncoder, batch "
                f"{t['batch']}x{t['seq']} tokens, loss mean(out^2)"
            ),
            build=on_device(
                zoo.seeded(
                    lambda: SequentialEncoder(
                        zoo.Encoder(t["d_model"], t["nhead"], t["num_layers"])
                    )
                )
            ),
            inputs=(zoo.randn(t["batch"], t["seq"], t["d_model"]).to(device),),
            loss=_zoo_loss("transformer"),
            config=t,
            sequence_length=t["num_layers"],
        ),
        ModelSpec(
            name="unet",
            description=(
                f"zoo.unet(depth={u['depth']}, width={u['width']}), 2 convs per level, "
                f"batch {u['batch']}x1x{u['size']}x{u['size']}, loss mean(out^2)"
            ),
            build=on_device(zoo.seeded(lambda: zoo.unet(u["depth"], u["width"]))),
            inputs=(zoo.randn(u["batch"], 1, u["size"], u["size"]).to(device),),
            loss=_zoo_loss("unet"),
            config=u,
            sequence_length=None,
            not_sequential_reason=(
                "not a sequence: encoder features are concatenated into the decoder (long skips), "
                "so no nn.Sequential of the whole model exists for checkpoint_sequential to split"
            ),
        ),
    ]
    for spec in specs:
        spec.device = device
    return specs


MODELS = ("resnet", "transformer", "unet")

# ------------------------------------------------------------------------------------- FLOPs

#: ``FlopCounterMode``'s formulas, plus the CPU flash-attention kernels its table lacks (their
#: arguments start like the CUDA flash kernels', whose formulas apply unchanged).
FLOP_FORMULAS: dict[Any, Callable[..., int]] = dict(flop_registry)
FLOP_FORMULAS[aten._scaled_dot_product_flash_attention_for_cpu] = flop_registry[
    aten._scaled_dot_product_flash_attention
]
FLOP_FORMULAS[aten._scaled_dot_product_flash_attention_for_cpu_backward] = flop_registry[
    aten._scaled_dot_product_flash_attention_backward
]


def _as_raw(formula: Callable[..., int]) -> Callable[..., int]:
    """A registered formula (already shape-wrapped) that ``FlopCounterMode`` must not wrap again."""

    def raw(*args: Any, **kwargs: Any) -> int:
        return formula(*args, **kwargs)

    raw._get_raw = True  # type: ignore[attr-defined]
    return raw


def counted_flops(fn: Callable[[], object]) -> int:
    """Total FLOPs (matmul, convolution, attention) that ``fn`` runs, by ``FlopCounterMode``."""
    extra = {k: _as_raw(v) for k, v in FLOP_FORMULAS.items() if k not in flop_registry}
    with FlopCounterMode(display=False, custom_mapping=extra) as counter:
        fn()
    return int(counter.get_total_flops())


class GraphFlops:
    """An Inductor post-grad pass that adds up the FLOPs of every graph it is shown, and a
    digest of the graphs: settings with one digest compiled one program."""

    def __init__(self) -> None:
        self.total = 0
        self.graphs = 0
        self.uncounted: set[str] = set()
        #: each graph's digest (strings: Inductor pickles its config, this pass included)
        self.digests: list[str] = []

    @property
    def program(self) -> str:
        return hashlib.sha256(" ".join(self.digests).encode()).hexdigest()[:16]

    def __call__(self, graph: fx.Graph) -> None:
        self.graphs += 1
        self.digests.append(hashlib.sha256(str(graph).encode()).hexdigest())
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            packet = getattr(node.target, "overloadpacket", None)
            formula = FLOP_FORMULAS.get(packet)
            if formula is None:
                continue
            args, kwargs = tree_map_only(
                fx.Node, lambda n: n.meta.get("val"), (node.args, node.kwargs)
            )
            try:
                self.total += int(formula(*args, **kwargs, out_val=node.meta.get("val")))
            except Exception:  # noqa: BLE001 - a node without shapes: say so, count the rest
                self.uncounted.add(str(packet))


# ------------------------------------------------------------------------------------- points


class Point(Method):
    """One peer at one setting: a ``memfit.bench.runner`` method whose module (the plain model
    until then) is built by its first step (``build_and_first_step``), under the settings that
    step needs.

    A memfit budget below the smallest feasible is *infeasible*, not failed: its ``BudgetError``
    is recorded with the smallest feasible bytes, which become a point of their own.
    """

    def __init__(self, spec: ModelSpec, peer: str, setting: str, params: dict[str, Any]) -> None:
        super().__init__(
            f"{peer} {setting}",
            spec.build(),
            self._train_step,
            record={"peer": peer, "setting": setting, **params},
        )
        self.spec = spec
        self.peer = peer
        self.setting = setting
        self.infeasible = False

    def _train_step(self) -> None:
        self.spec.loss(self.module(*self.spec.inputs)).backward()

    def fail(self, phase: str, err: BaseException) -> None:
        if not isinstance(err, memfit.BudgetError):
            super().fail(phase, err)
            return
        self.failed = self.infeasible = True
        self.record["budget_error"] = str(err)
        self.record["smallest_bytes"] = err.least_bytes
        print(
            f"    {self.name}: BudgetError (smallest feasible "
            f"{(err.least_bytes or 0) / MIB:.1f} MiB)",
            flush=True,
        )

    def ok(self) -> bool:
        return not self.failed

    @property
    def status(self) -> str:
        return "infeasible" if self.infeasible else ("failed" if self.failed else "ok")


def make_points(
    spec: ModelSpec,
    compile_budgets: tuple[float, ...],
    memfit_budgets: tuple[float, ...],
    peers: tuple[str, ...] = PEERS,
    executor: str = "eager",
    modes: tuple[str, ...] = MEMFIT_MODES,
    autotune: bool = False,
) -> list[Point]:
    points = [Point(spec, "eager", "plain", {})]  # the reference: always there
    if "checkpoint_sequential" in peers and spec.sequence_length is not None:
        for s in range(1, spec.sequence_length + 1):
            points.append(Point(spec, "checkpoint_sequential", f"{s} seg", {"segments": s}))
    for b in compile_budgets if "torch.compile" in peers else ():
        points.append(
            Point(spec, "torch.compile", f"budget {b:g}", {"activation_memory_budget": b})
        )
    for mode in modes if "memfit" in peers else ():
        points.append(Point(spec, "memfit", f"mode {mode}", {"mode": mode, "executor": executor}))
    for f in memfit_budgets if "memfit" in peers else ():
        points.append(Point(spec, "memfit", f"budget {f:g}", budget_record(f, executor, autotune)))
    return points


def budget_record(budget: float | int, executor: str, autotune: bool) -> dict[str, Any]:
    """What a memfit budget point is built from (``warm_up``): every budget point, the
    fractions and the smallest feasible bytes alike, gets its record here."""
    return {"budget": budget, "executor": executor, "autotune": autotune}


def _record_plan(p: Point) -> None:
    assert isinstance(p.module, memfit.CheckpointedModule), p.module
    plan = p.module.memfit.plan
    p.record.update(plan_record(plan))
    p.record["recompute_flops_method"] = (
        "memfit plan.recompute_flops (flop_counter formulas "
        "for matmul/conv/attention + 1 per output element of "
        "other ops)"
    )
    if plan.budget_bytes is not None:
        p.record["budget_bytes"] = plan.budget_bytes
    p.record["program"] = plan_program(plan)


def plan_program(plan: memfit.Plan) -> str:
    """A digest of what memfit's executor builds its graphs from: per captured graph, its key
    and its decisions in order, its attention kernels and transfers, and the regions recomputed
    whole. Settings with one digest run one program (``_pooled_medians``); the digest never
    equals a ``torch.compile`` setting's (``GraphFlops.program``), which digests graphs."""
    parts = [repr(plan.regions)]
    for g in plan.graphs:
        parts.append(g.key)
        parts.extend(f"{name}={d.value}" for name, d in g.decisions.items())
        parts += [repr(g.attention), repr(g.transfers)]
    return "memfit " + hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def memfit_predicted_frontier(points: list[Point]) -> list[dict[str, Any]] | None:
    """memfit's simulated (peak, recompute cost) frontier, from the first budget point's plan."""
    for p in points:
        if "budget" in p.record and p.ok() and isinstance(p.module, memfit.CheckpointedModule):
            try:
                return [
                    {
                        "peak_bytes": q.peak_bytes,
                        "recompute_flops": int(q.recompute_flops),
                        "recompute_seconds": q.recompute_seconds,
                        "kept_bytes": q.kept_bytes,
                    }
                    for q in p.module.memfit.plan.pareto()
                ]
            except Exception as err:  # noqa: BLE001 - informative only
                return [{"error": f"{type(err).__name__}: {err}"}]
    return None


def build_and_first_step(p: Point) -> None:
    """Build ``p.module`` and run its first step (compilation, capture, planning) under the
    settings it needs; record what that step decided."""
    tag = f"{p.spec.name}_{p.peer}_{p.setting}"
    graphs_before = unique_graph_count()
    counter = GraphFlops()
    with ExitStack() as stack:
        if p.peer == "eager":
            p.module = p.model
        elif p.peer == "checkpoint_sequential":
            p.module = SequentialCheckpointed(p.model, p.record["segments"])
        elif p.peer == "torch.compile":
            stack.enter_context(activation_memory_budget(p.record["activation_memory_budget"]))
            stack.enter_context(inductor_post_grad_pass(counter))
            p.module = torch.compile(entry_point(p.model, tag))  # type: ignore[assignment]
        else:
            entry = entry_point(p.model, tag)
            executor = p.record["executor"]
            if "mode" in p.record:
                p.module = memfit.checkpoint(entry, p.record["mode"], executor=executor)
            else:
                p.module = memfit.checkpoint(
                    entry,
                    p.record["budget"],
                    executor=executor,
                    options=memfit.Options(autotune=p.record["autotune"]),
                )
        first_step(p, p.spec.device)
    p.record["graphs_compiled"] = unique_graph_count() - graphs_before
    if p.peer == "torch.compile":
        p.record["compiled_graph_flops"] = counter.total
        p.record["compiled_graphs_counted"] = counter.graphs
        p.record["program"] = counter.program
        if counter.uncounted:
            p.record["flops_uncounted_ops"] = sorted(counter.uncounted)
    if p.peer == "memfit":
        _record_plan(p)


def warm_up(p: Point) -> None:
    """The first step, then a second (caches, allocator, lazy initialisation)."""
    if attempt(p, FIRST_STEP, partial(build_and_first_step, p)):
        attempt(p, "warming up (second step)", p.run_step)


def count_eager_flops(p: Point) -> None:
    """``FlopCounterMode`` total of one eager step (plain or ``checkpoint_sequential``)."""

    def count() -> None:
        p.zero_grad()
        p.record["step_flops"] = counted_flops(p.step)

    attempt(p, "counting FLOPs", count)


# ------------------------------------------------------------------------------------- one model


def measure_and_time(
    spec: ModelSpec, points: list[Point], args: argparse.Namespace, phases: dict[str, float]
) -> tuple[int | None, list[Any], dict[str, Any]]:
    """Peaks, FLOPs and interleaved timing of warmed-up points: what the timing lock spans.

    Returns plain eager's step FLOPs, the load average at the start and end of the timing, and
    ``time_interleaved``'s account of the heap it collected before each step.
    """
    print(f"  {spec.name}: measuring peaks and FLOPs", flush=True)
    t_phase = time.perf_counter()
    measure_peaks(points, spec.device)
    eager = points[0]
    for p in points:
        if p.ok() and p.peer in ("eager", "checkpoint_sequential"):
            count_eager_flops(p)
    eager_flops = eager.record.get("step_flops")
    for p in points:
        rec = p.record
        if eager_flops is None or not p.ok():
            continue
        if p.peer == "checkpoint_sequential" and "step_flops" in rec:
            rec["recompute_flops"] = rec["step_flops"] - eager_flops
            rec["recompute_flops_method"] = (
                "FlopCounterMode total of the step minus eager's (matmul/conv/attention)"
            )
        elif p.peer == "torch.compile" and "compiled_graph_flops" in rec:
            rec["recompute_flops"] = rec["compiled_graph_flops"] - eager_flops
            rec["recompute_flops_method"] = (
                "flop_counter formulas over Inductor's post-grad forward+backward graphs minus "
                "eager's FlopCounterMode total (matmul/conv/attention)"
            )
        elif p.peer == "eager":
            rec["recompute_flops"] = 0
    phases["peaks_and_flops"] = time.perf_counter() - t_phase

    print(f"  {spec.name}: timing {args.rounds} interleaved rounds", flush=True)
    t_phase = time.perf_counter()
    load_timing = [load_average()]
    reported = [-1]

    def progress(point: Point, rnd: int) -> None:
        # a run cut while timing says how far it got, and how fast
        if rnd > reported[0] and rnd % 5 == 0:
            reported[0] = rnd
            print(f"    round {rnd}: {time.perf_counter() - t_phase:.0f} s", flush=True)

    heap = time_interleaved(
        points,
        args.rounds,
        spec.device,
        progress,
        settle=args.settle,
        steps=args.steps_per_turn,
    )
    phases["timing"] = time.perf_counter() - t_phase
    print(
        f"  {spec.name}: timed in {phases['timing']:.0f} s; a collection before a step took "
        f"{heap['collect_s'] * 1e3:.1f} ms ({heap['frozen_objects']} objects frozen, "
        f"{heap['frozen_before']} of them before the timing)",
        flush=True,
    )
    load_timing.append(load_average())
    return eager_flops, load_timing, heap


def run_model(spec: ModelSpec, args: argparse.Namespace) -> dict[str, Any]:
    t_model = time.perf_counter()
    torch.compiler.reset()  # once per model; every point then compiles its own code object
    compile_budgets, memfit_budgets = args.compile_budgets, args.memfit_budgets
    points = make_points(
        spec,
        compile_budgets,
        memfit_budgets,
        tuple(args.peers),
        args.executor,
        tuple(args.memfit_modes),
        args.autotune,
    )

    print(f"  {spec.name}: {len(points)} points; warming up", flush=True)
    smallest: int | None = None
    for p in points:
        warm_up(p)
        if p.infeasible and p.record.get("smallest_bytes"):
            smallest = int(p.record["smallest_bytes"])
        rec = p.record
        if p.ok():
            print(f"    {p.name}: first step {rec['first_step_s']:.1f} s", flush=True)
    if smallest is not None:
        p = Point(
            spec,
            "memfit",
            "budget smallest",
            {
                **budget_record(smallest, args.executor, args.autotune),
                "budget_is_smallest_feasible": True,
            },
        )
        points.append(p)
        warm_up(p)
        if p.ok():
            print(
                f"    {p.name} ({smallest / MIB:.1f} MiB): first step "
                f"{p.record['first_step_s']:.1f} s",
                flush=True,
            )
    before = Snapshot(points)
    frontier = memfit_predicted_frontier(points)
    phases = {"warm_up": time.perf_counter() - t_model}

    lock: TimingLock | None = args.lock
    with lock.exclusive() if lock else nullcontext(0.0) as waited:
        if lock:
            phases["waited_for_timing_lock"] = waited
            print(f"  {spec.name}: waited {waited:.0f} s for the timing lock", flush=True)
        eager_flops, load_timing, heap = measure_and_time(spec, points, args, phases)
    graphs_during = before.graphs_compiled()
    eager = points[0]

    out_points = []
    for p in points:
        rec = p.record
        if rec["times_s"]:
            rec["time_s"] = statistics.median(rec["times_s"])
            rec["time_min_s"] = min(rec["times_s"])
            rec["time_max_s"] = max(rec["times_s"])
            if len(rec["times_s"]) >= 2:
                q1, _, q3 = statistics.quantiles(rec["times_s"], n=4, method="inclusive")
            else:
                q1 = q3 = rec["time_s"]
            rec["time_q1_s"], rec["time_q3_s"] = q1, q3
            rec["faults_median"] = statistics.median(rec["faults"])
        rec["status"] = p.status
        out_points.append(rec)
    return {
        "name": spec.name,
        "description": spec.description,
        "config": spec.config,
        "parameters": sum(q.numel() for q in eager.model.parameters()),
        "sequence_length": spec.sequence_length,
        "checkpoint_sequential": (
            f"applies to model.blocks, segments 1..{spec.sequence_length}"
            if spec.sequence_length
            else f"N/A: {spec.not_sequential_reason}"
        ),
        "eager_step_flops": eager_flops,
        "memfit_predicted_frontier": frontier,
        "graphs_compiled_during_measurement": graphs_during,
        "seconds": round(time.perf_counter() - t_model, 1),
        "phase_seconds": {k: round(v, 1) for k, v in phases.items()},
        "load_average_during_timing": {"start": load_timing[0], "end": load_timing[1]},
        # what a collection before each timed step costs (``time_interleaved``)
        "timing_heap": heap,
        "points": out_points,
    }


# ------------------------------------------------------------------------------------- analysis


def _usable(rec: dict[str, Any]) -> bool:
    return rec.get("status") == "ok" and "peak_bytes" in rec and "time_s" in rec


def pareto_front(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Points no other point beats on both measured peak and step time, by increasing peak."""
    front: list[dict[str, Any]] = []
    for rec in sorted(
        (r for r in points if _usable(r)), key=lambda r: (r["peak_bytes"], r["time_s"])
    ):
        if not front or rec["time_s"] < front[-1]["time_s"]:
            front.append(rec)
    return front


def equal_peak_comparison(
    points: list[dict[str, Any]], steps_per_turn: int = 1
) -> list[dict[str, Any]]:
    """For each memfit point, the fastest point of each peer family peaking at most
    ``PEAK_TOLERANCE`` times higher, and memfit's time over that peer's. ``steps_per_turn``:
    how many consecutive timed steps of a point ran in one turn (``paired_interval``)."""
    families = {
        "torch.compile": ("torch.compile",),
        "eager/checkpoint_sequential": ("eager", "checkpoint_sequential"),
    }
    rows = []
    mine = [r for r in points if r["peer"] == "memfit" and _usable(r)]
    for m, m_pooled, m_steps in zip(mine, _pooled_medians(mine), _program_steps(mine)):
        row: dict[str, Any] = {
            "memfit": m["setting"],
            "peak_bytes": m["peak_bytes"],
            "time_s": m["time_s"],
            "peers": {},
        }
        for family, peers in families.items():
            cands = [
                r
                for r in points
                if r["peer"] in peers
                and _usable(r)
                and r["peak_bytes"] <= m["peak_bytes"] * PEAK_TOLERANCE
            ]
            if not cands:
                row["peers"][family] = None
                continue
            best = min(cands, key=lambda r: r["time_s"])
            row["peers"][family] = {
                "peer": best["peer"],
                "setting": best["setting"],
                "peak_bytes": best["peak_bytes"],
                "time_s": best["time_s"],
                "time_ratio": m["time_s"] / best["time_s"],
                # The same comparison on each point's fastest step: a shared machine's noise
                # lengthens steps and never shortens them, so minima separate small differences
                # that medians blur.
                "min_time_ratio": m["time_min_s"] / min(r["time_min_s"] for r in cands),
                "pooled_time_ratio": m_pooled / min(_pooled_medians(cands)),
                # The pooled programs compared turn by turn: what drifts between turns (a
                # shared machine's speed) divides out. Against the peer program memfit fares
                # worst against, with that ratio's 95% interval over turns.
                **_worst_paired(m_steps, _program_steps(cands), steps_per_turn),
            }
        rows.append(row)
    return rows


def _per_program(
    points: list[dict[str, Any]], measure: Callable[[list[list[float]]], Any]
) -> list[Any]:
    """For each of ``points``, ``measure`` of the step times (one list per setting) of every
    setting that ran its program: a recorded digest, or the point itself if it has none."""
    keys = [str(r.get("program") or f"point {i}") for i, r in enumerate(points)]
    programs: dict[str, list[list[float]]] = {}
    for key, r in zip(keys, points):
        programs.setdefault(key, []).append(r["times_s"])
    measured = {key: measure(runs) for key, runs in programs.items()}
    return [measured[key] for key in keys]


def _pooled_medians(points: list[dict[str, Any]]) -> list[float]:
    """For each of ``points``, the median step time of its program, every step of the settings that
    ran it pooled (``program``: for ``torch.compile``, a digest of the graphs Inductor compiled;
    for memfit, of its plan's decisions; a point without one is its own program).

    Why: several ``activation_memory_budget`` values may compile one program (the ResNet's 0.6
    to 0.9 all peaked at 33.7 MiB, nothing recomputed), and several memfit budgets may pick one
    plan (the U-Net's 0.4, 0.3 and 0.25). The fastest of a program's medians is the least of
    several noisy measurements of one time, lower than the time itself, and the slowest is
    higher; compared setting by setting, either side is "slower" by the noise alone. Pooled, the
    program is one point, timed over all its steps.
    """
    return _per_program(points, lambda runs: statistics.median(t for r in runs for t in r))


def _program_steps(points: list[dict[str, Any]]) -> list[list[float]]:
    """For each of ``points``, its program's steps in the order they ran: step k the mean of
    the k-th steps of the settings that ran that program (``_pooled_medians``).

    Why: timing goes round-robin over all of a model's points, so the k-th steps of every point
    ran in the same turn, within a second or so of each other, while a shared machine's speed
    drifts by 10% and more over the minutes between turns. Compared step k against step k
    (``_paired``), that drift divides out; medians taken over each side's whole run keep it
    (the ResNet's one 33.7 MiB ``torch.compile`` program measured 91-97 ms at four settings of
    one run, 0.98-1.06x memfit's ``"speed"`` turn by turn)."""
    # zip: as many steps as the shortest setting's
    return _per_program(points, lambda runs: [statistics.mean(k) for k in zip(*runs)])


def _paired(mine: list[float], peer: list[float]) -> float:
    """The median over steps k of ``mine[k] / peer[k]``: steps of one turn compared."""
    return statistics.median(a / b for a, b in zip(mine, peer))


#: Resamples of ``paired_interval``'s bootstrap, and its seed (the interval is reproducible).
BOOTSTRAP_RESAMPLES = 2000
_BOOTSTRAP_SEED = 0


def paired_interval(
    mine: list[float], peer: list[float], steps_per_turn: int
) -> tuple[float, float]:
    """The 95% bootstrap interval of ``_paired(mine, peer)``, resampling whole turns.

    Why: on a shared 2-core machine one program's step times spread by 10% and more within a
    run, so a turn-by-turn median of 1.01 may be noise or a real 1% (the ResNet's
    ``budget=0.6`` plan, the same partition as ``torch.compile``'s 33.7 MiB program, measured
    1.04 against it in one frontier run and 1.007 over 100 rounds head to head). Only an
    interval wholly above 1 says memfit's point is slower. The steps of one turn ran back to back
    and share the machine's state, so turns, not steps, are what is resampled.
    """
    ratios = np.array([a / b for a, b in zip(mine, peer)])
    block = max(1, steps_per_turn)
    turns = len(ratios) // block
    if turns < 2:
        value = _paired(mine, peer)
        return value, value
    by_turn = ratios[: turns * block].reshape(turns, block)
    rng = np.random.default_rng(_BOOTSTRAP_SEED)
    picks = rng.integers(0, turns, size=(BOOTSTRAP_RESAMPLES, turns))
    medians = np.median(by_turn[picks].reshape(BOOTSTRAP_RESAMPLES, -1), axis=1)
    lo, hi = np.quantile(medians, [0.025, 0.975])
    return float(lo), float(hi)


def _worst_paired(
    mine: list[float], peers: list[list[float]], steps_per_turn: int
) -> dict[str, Any]:
    """Of the peer programs ``peers``, the one memfit's turn-by-turn ratio is highest against:
    that ratio (``paired_time_ratio``) and its interval (``paired_interval``)."""
    worst = max(peers, key=lambda c: _paired(mine, c))
    return {
        "paired_time_ratio": _paired(mine, worst),
        "paired_interval": list(paired_interval(mine, worst, steps_per_turn)),
    }


def same_program_pairs(
    points: list[dict[str, Any]], steps_per_turn: int = 1
) -> list[dict[str, Any]]:
    """Every two settings of one peer that ran one program (one ``program`` digest), the first's
    steps over the second's turn by turn (``_paired``), with that ratio's interval
    (``paired_interval``): the frontier's own comparison where nothing differs, an A/A test.

    Why: memfit's ResNet budget plans compile ``torch.compile``'s own partition (the same
    kernels every step, but one copy: docs/measurements.md, "Speed: the Inductor executor on
    CPU"), and two frontier runs of the same plans read them 1.05 (1.01-1.10) and 0.98 turn by
    turn against it. Settings that ran one program differ only by where their memory lies and
    when their turns ran; a ratio as far from 1 as the run puts them is one the run cannot
    resolve.
    Single settings are noisier than the pooled programs the comparison with ``torch.compile``
    uses (``_program_steps``), so their spread is, if anything, wider than that comparison's
    noise.
    """
    programs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in points:
        if _usable(r) and r.get("program"):
            programs.setdefault((r["peer"], str(r["program"])), []).append(r)
    pairs = []
    for (peer, _), settings in programs.items():
        for a, b in itertools.combinations(settings, 2):
            pairs.append(
                {
                    "peer": peer,
                    "settings": [a["setting"], b["setting"]],
                    "paired_time_ratio": _paired(a["times_s"], b["times_s"]),
                    "paired_interval": list(
                        paired_interval(a["times_s"], b["times_s"], steps_per_turn)
                    ),
                }
            )
    return pairs


def same_program_summary(pairs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Over ``same_program_pairs``: how many, the widest and the median distance of their
    ratios from 1 (as ``max(r, 1/r)``: which setting is first is arbitrary), and how many have an
    interval wholly above or below 1 (``beyond_noise``: "slower beyond noise" where nothing
    differs); None without pairs."""
    if not pairs:
        return None
    spread = [max(p["paired_time_ratio"], 1 / p["paired_time_ratio"]) for p in pairs]
    return {
        "pairs": len(pairs),
        "widest": max(spread),
        "median": statistics.median(spread),
        "beyond_noise": sum(lo > 1 or hi < 1 for lo, hi in (p["paired_interval"] for p in pairs)),
    }


# ------------------------------------------------------------------------------------- reporting


def _mib(n: float | None) -> str:
    return f"{n / MIB:.1f}" if n is not None else "-"


def _ms(s: float | None) -> str:
    return f"{s * 1e3:.0f}" if s is not None else "-"


def _gflops(n: float | None) -> str:
    return f"{n / 1e9:.2f}" if n is not None else "-"


def own_baseline(points: list[dict[str, Any]], rec: dict[str, Any]) -> dict[str, Any] | None:
    """The same peer with nothing recomputed: memfit ``"none"``, ``torch.compile`` at budget 1.0,
    plain eager for ``checkpoint_sequential``. Time over it separates what checkpointing costs
    from how fast the peer's executor is (Inductor fuses; memfit and eager run ATen ops)."""

    def find(pred: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
        return next((r for r in points if pred(r) and _usable(r)), None)

    if rec["peer"] == "memfit":
        return find(lambda r: r["peer"] == "memfit" and r.get("mode") == "none")
    if rec["peer"] == "torch.compile":
        return find(lambda r: r["peer"] == "torch.compile" and r["activation_memory_budget"] == 1.0)
    return find(lambda r: r["peer"] == "eager")


def points_table(res: dict[str, Any]) -> str:
    eager = next(r for r in res["points"] if r["peer"] == "eager")
    e_peak, e_time = eager.get("peak_bytes"), eager.get("time_s")
    front = {id(r) for r in pareto_front(res["points"])}
    lines = [
        "| peer | setting | peak MiB | peak / eager | predicted MiB | step ms (IQR) | "
        "min ms | page faults / step | time / eager | time / own baseline | recomputed GFLOP | "
        "first step s | Pareto |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:-:|",
    ]
    for peer in PEERS:
        recs = [r for r in res["points"] if r["peer"] == peer]
        if peer == "checkpoint_sequential" and not recs:
            lines.append(
                f"| checkpoint_sequential | N/A | {res['checkpoint_sequential']} "
                "| | | | | | | | | | |"
            )
            continue
        for r in sorted(recs, key=lambda r: r.get("peak_bytes") or math.inf):
            if r["status"] == "infeasible":
                lines.append(
                    f"| {peer} | {r['setting']} | BudgetError: smallest feasible "
                    f"{_mib(r.get('smallest_bytes'))} MiB | | | | | | | | | | |"
                )
                continue
            if r["status"] == "failed":
                err = r["error"].splitlines()[0][:120].replace("|", "\\|")
                lines.append(
                    f"| {peer} | {r['setting']} | failed while {r['error_phase']}: "
                    f"`{err}` | | | | | | | | | | |"
                )
                continue
            setting = r["setting"]
            if r.get("budget_is_smallest_feasible"):
                setting = f"budget = smallest ({_mib(r['budget'])} MiB)"
            peak, t = r.get("peak_bytes"), r.get("time_s")
            spread = (
                f"{_ms(t)} ({_ms(r['time_q1_s'])}-{_ms(r['time_q3_s'])})" if t is not None else "-"
            )
            base = own_baseline(res["points"], r)
            cells = [
                peer,
                setting,
                _mib(peak),
                f"{peak / e_peak:.2f}" if peak and e_peak else "-",
                _mib(r.get("predicted_peak_bytes")),
                spread,
                _ms(r.get("time_min_s")),
                f"{r['faults_median']:.0f}" if "faults_median" in r else "-",
                f"{t / e_time:.2f}" if t and e_time else "-",
                f"{t / base['time_s']:.2f}" if t and base else "-",
                _gflops(r.get("recompute_flops")),
                f"{r['first_step_s']:.1f}" if "first_step_s" in r else "-",
                "*" if id(r) in front else "",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def comparison_table(res: dict[str, Any], steps_per_turn: int) -> tuple[str, list[str]]:
    rows = equal_peak_comparison(res["points"], steps_per_turn)
    lines = [
        "| memfit | peak MiB | step ms | fastest torch.compile at <= 1.05x peak | "
        "memfit / it | turn by turn (95% interval) | fastest eager or checkpoint_sequential "
        "at <= 1.05x peak | memfit / it |",
        "|---|---:|---:|---|---:|---:|---|---:|",
    ]
    losses = []
    for row in rows:
        cells = [row["memfit"], _mib(row["peak_bytes"]), _ms(row["time_s"])]
        for family in ("torch.compile", "eager/checkpoint_sequential"):
            best = row["peers"][family]
            if best is None:
                if family == "eager/checkpoint_sequential" and res["sequence_length"] is None:
                    cells += ["none this low (checkpoint_sequential N/A)", "-"]
                else:
                    cells += ["none this low", "-"]
                if family == "torch.compile":
                    cells.append("-")
                continue
            ratio = best["time_ratio"]
            cells += [
                f"{best['peer']} {best['setting']}: {_mib(best['peak_bytes'])} MiB, "
                f"{_ms(best['time_s'])} ms",
                f"**{ratio:.2f}**" if ratio > 1 else f"{ratio:.2f}",
            ]
            if family == "torch.compile":
                lo, hi = best["paired_interval"]
                paired = f"{best['paired_time_ratio']:.2f} ({lo:.2f}-{hi:.2f})"
                cells.append(f"**{paired}**" if lo > 1 else paired)
            if ratio > 1:
                losses.append(
                    f"{res['name']}: memfit {row['memfit']} is {ratio:.2f}x the time of "
                    f"{best['peer']} {best['setting']} at equal peak"
                )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines), losses


def same_program_text(pairs: list[dict[str, Any]]) -> str:
    """What ``same_program_pairs`` found, said under the comparison it calibrates."""
    s = same_program_summary(pairs)
    if s is None:
        return "No two settings of one peer ran one program: this run has no A/A check."
    each = "; ".join(
        f"{p['peer']} {p['settings'][0]} / {p['settings'][1]} {p['paired_time_ratio']:.3f} "
        f"({p['paired_interval'][0]:.2f}-{p['paired_interval'][1]:.2f})"
        for p in pairs
    )
    return (
        f"A/A check: {s['pairs']} pairs of settings that ran one program, compared turn by turn "
        f"as above, were up to {s['widest']:.3f}x apart (median {s['median']:.3f}x), "
        f"{s['beyond_noise']} with an interval excluding 1: a ratio that close to 1 is within "
        f"this run's noise. {each}."
    )


def ratio_summary(rows: list[dict[str, Any]], family: str) -> dict[str, Any] | None:
    """Over the rows of ``equal_peak_comparison`` that have a ``family`` point at their peak:
    how many, how many memfit points were slower (by more than 5%), and the median and worst
    memfit / peer ratio setting by setting (``medians``), on fastest steps (``fastest``),
    with one program's settings pooled (``pooled``), and those programs compared turn by turn
    (``paired``), with how many of those ratios' 95% intervals lie wholly above 1
    (``paired_beyond_noise``: slower by more than the run's noise); None if no row has such a
    point."""
    peers = [r["peers"][family] for r in rows if r["peers"][family]]
    if not peers:
        return None
    ratios = [p["time_ratio"] for p in peers]
    out: dict[str, Any] = {
        "compared": len(peers),
        "slower": sum(x > 1 for x in ratios),
        "slower_by_5pct": sum(x > 1.05 for x in ratios),
        "paired_beyond_noise": sum(p["paired_interval"][0] > 1 for p in peers),
    }
    for label, key in (
        ("medians", "time_ratio"),
        ("fastest", "min_time_ratio"),
        ("pooled", "pooled_time_ratio"),
        ("paired", "paired_time_ratio"),
    ):
        values = [p[key] for p in peers]
        out[label] = (statistics.median(values), max(values))
    return out


def summary_table(results: list[dict[str, Any]], steps_per_turn: int) -> str:
    """Per model and peer family: how memfit's points fare against the fastest peer point at
    equal measured peak."""
    lines = [
        "| model | peer | memfit points with a peer point at <= 1.05x their peak | "
        "memfit slower | slower by > 5% | median memfit / peer | worst | "
        "median on fastest steps | worst | median, one program pooled | worst | "
        "median, pooled, turn by turn | worst | turn by turn, slower beyond noise |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for res in results:
        rows = equal_peak_comparison(res["points"], steps_per_turn)
        for family in ("torch.compile", "eager/checkpoint_sequential"):
            s = ratio_summary(rows, family)
            if s is None:
                lines.append(
                    f"| {res['name']} | {family} | 0 of {len(rows)} | - | - | - | - | - | - "
                    "| - | - | - | - | - |"
                )
                continue
            cells = [
                f"{s[k][0]:.2f} | {s[k][1]:.2f}" for k in ("medians", "fastest", "pooled", "paired")
            ]
            lines.append(
                f"| {res['name']} | {family} | {s['compared']} of {len(rows)} | "
                f"{s['slower']} | {s['slower_by_5pct']} | " + " | ".join(cells) + " | "
                f"{s['paired_beyond_noise']} |"
            )
    return "\n".join(lines)


_STYLE = {
    "eager": dict(color="black", marker="*", markersize=12, linestyle="none"),
    "checkpoint_sequential": dict(color="tab:orange", marker="D", markersize=5),
    "torch.compile": dict(color="tab:blue", marker="o", markersize=5),
    "memfit budget": dict(color="tab:green", marker="v", markersize=6),
    "memfit modes": dict(
        color="tab:green", marker="s", markersize=8, linestyle="none", markerfacecolor="none"
    ),
}


#: Each peer's points are joined in the order of its own knob, so a peak that does not follow
#: the knob shows as a line that doubles back.
_SETTING_ORDER: dict[str, Callable[[dict[str, Any]], Any]] = {
    "checkpoint_sequential": lambda r: r["segments"],
    "torch.compile": lambda r: -r["activation_memory_budget"],
    "memfit budget": lambda r: (bool(r.get("budget_is_smallest_feasible")), -r["budget"]),
}


def write_plot(res: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6))
    groups: dict[str, list[dict[str, Any]]] = {k: [] for k in _STYLE}
    for r in res["points"]:
        if not _usable(r):
            continue
        key = r["peer"]
        if key == "memfit":
            key = "memfit modes" if "mode" in r else "memfit budget"
        groups[key].append(r)
    for key, recs in groups.items():
        if not recs:
            continue
        recs = sorted(recs, key=_SETTING_ORDER.get(key, lambda r: r["peak_bytes"]))
        xs = [r["peak_bytes"] / MIB for r in recs]
        ys = [r["time_s"] * 1e3 for r in recs]
        lo = [(r["time_s"] - r["time_q1_s"]) * 1e3 for r in recs]
        hi = [(r["time_q3_s"] - r["time_s"]) * 1e3 for r in recs]
        style = dict(_STYLE[key])
        ax.errorbar(xs, ys, yerr=[lo, hi], label=key, elinewidth=0.6, capsize=2, **style)
        for r, x, y in zip(recs, xs, ys):
            text = {
                "torch.compile": lambda r: f"{r['activation_memory_budget']:g}",
                "checkpoint_sequential": lambda r: f"{r['segments']}",
                "memfit modes": lambda r: r["mode"],
                "memfit budget": lambda r: (
                    "min" if r.get("budget_is_smallest_feasible") else f"{r['budget']:g}"
                ),
                "eager": lambda r: "eager",
            }[key](r)
            ax.annotate(
                text,
                (x, y),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=7,
                color=style["color"],
            )
    front = pareto_front(res["points"])
    if front:
        fx_ = [r["peak_bytes"] / MIB for r in front]
        fy = [r["time_s"] * 1e3 for r in front]
        ax.step(
            fx_,
            fy,
            where="post",
            color="gray",
            linestyle="--",
            linewidth=1,
            label="Pareto front (all peers)",
            zorder=0,
        )
    ax.set_xlabel("measured peak tensor memory of one training step (MiB)")
    ax.set_ylabel("step time, median (ms); bars: interquartile range")
    ax.set_xlim(left=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    note = (
        "labels: torch.compile activation_memory_budget, checkpoint_sequential segments, "
        "memfit budget fraction; lines follow each knob"
    )
    ax.set_title(f"{title}\n{note}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------- main


def _at_least(least: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
        return value

    return parse


def add_turn_arguments(p: argparse.ArgumentParser, *, settle: int, steps: int) -> None:
    """``--settle`` and ``--steps-per-turn``: how each point's turn in the interleaved timing
    runs (``memfit.bench.runner.time_interleaved``), with these defaults."""
    p.add_argument(
        "--settle",
        type=_at_least(0),
        default=settle,
        help=f"untimed steps at the start of each point's turn (default {settle})",
    )
    p.add_argument(
        "--steps-per-turn",
        type=_at_least(1),
        default=steps,
        help=f"timed steps in each point's turn, after the untimed ones (default {steps})",
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny models, few points, 3 rounds; outputs get '_quick'",
    )
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument(
        "--peers",
        nargs="+",
        choices=PEERS,
        default=list(PEERS),
        help="peers to run (plain eager always runs: it is the reference)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="timed rounds per point (median); default 15, --quick 3",
    )
    add_turn_arguments(p, settle=1, steps=2)
    p.add_argument(
        "--executor",
        choices=[str(e) for e in memfit.Executor],
        default="eager",
        help="how memfit runs its plans; outputs get '_inductor' for inductor",
    )
    p.add_argument(
        "--autotune",
        action="store_true",
        help="memfit's budgets with autotune=True (needs --executor inductor): each timed "
        'against "speed"\'s plan on its first step',
    )
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument(
        "--batch-scale",
        type=int,
        default=1,
        metavar="N",
        help="multiply every model's batch by N (default 1: the CPU sizes)",
    )
    p.add_argument(
        "--compile-budgets",
        type=float,
        nargs="+",
        default=None,
        metavar="B",
        help="torch.compile activation_memory_budget values (default "
        f"{' '.join(map(str, COMPILE_BUDGETS))})",
    )
    p.add_argument(
        "--memfit-budgets",
        type=float,
        nargs="+",
        default=None,
        metavar="F",
        help=f"memfit budget fractions (default {' '.join(map(str, MEMFIT_BUDGETS))})",
    )
    p.add_argument(
        "--memfit-modes",
        nargs="*",
        choices=MEMFIT_MODES,
        default=list(MEMFIT_MODES),
        help=f"memfit modes to run (default {' '.join(MEMFIT_MODES)})",
    )
    p.add_argument("--out", "--out-dir", dest="out_dir", type=Path, default=RESULTS)
    p.add_argument(
        "--timing-lock",
        type=Path,
        default=None,
        metavar="FILE",
        help="runs of one model each, started in parallel with the same FILE, compile at once "
        "and time one at a time, once none is compiling (memfit.bench.timing_lock)",
    )
    args = p.parse_args(argv)
    if args.timing_lock and len(args.models) != 1:
        p.error("--timing-lock runs one model per process: name one in --models")
    if args.rounds is None:
        args.rounds = 3 if args.quick else 15
    if args.batch_scale < 1:
        p.error("--batch-scale must be at least 1")
    for name, values in (("compile", args.compile_budgets), ("memfit", args.memfit_budgets)):
        if values is not None and not all(0 < v <= 1 for v in values):
            p.error(f"--{name}-budgets must be fractions in (0, 1]")
    # a run of other sizes or points never overwrites the full results (see main's file names)
    args.default_points = (
        args.compile_budgets is None
        and args.memfit_budgets is None
        and tuple(args.memfit_modes) == MEMFIT_MODES
    )
    if args.compile_budgets is None:
        args.compile_budgets = QUICK_COMPILE_BUDGETS if args.quick else COMPILE_BUDGETS
    if args.memfit_budgets is None:
        args.memfit_budgets = QUICK_MEMFIT_BUDGETS if args.quick else MEMFIT_BUDGETS
    args.compile_budgets = tuple(args.compile_budgets)
    args.memfit_budgets = tuple(args.memfit_budgets)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            p.error("--device cuda: CUDA is not available")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.index >= torch.cuda.device_count():
            p.error(f"--device {args.device}: only {torch.cuda.device_count()} CUDA devices")
    elif device.type != "cpu":
        p.error(f"--device must be cpu or cuda, not {args.device!r}")
    args.device = device
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.lock = TimingLock(args.timing_lock) if args.timing_lock else None
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    device: torch.device = args.device
    stem = args.out_dir / (  # a run of other sizes or points never overwrites the full results
        "budget_frontier"
        + ("" if args.executor == "eager" else f"_{args.executor}")
        + ("" if device.type == "cpu" else f"_{device.type}")
        + ("" if args.batch_scale == 1 else f"_batch{args.batch_scale}x")
        + ("" if args.default_points else "_points")
        + ("_quick" if args.quick else "")
    )
    specs = [s for s in model_specs(args.quick, device, args.batch_scale) if s.name in args.models]

    started = time.perf_counter()
    load_start = load_average()
    print(
        f"budget frontier on {device}: {[s.name for s in specs]}, {args.rounds} rounds of "
        f"{args.settle} untimed + {args.steps_per_turn} timed steps, "
        f"{torch.get_num_threads()} threads (OMP_WAIT_POLICY="
        f"{os.environ.get('OMP_WAIT_POLICY')}), load average {load_start}",
        flush=True,
    )
    results = [run_model(spec, args) for spec in specs]
    torch.compiler.reset()
    total = time.perf_counter() - started

    report = {
        "benchmark": "budget_frontier",
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(device),
        "software": software_info(ROOT),
        "parameters": {
            "quick": args.quick,
            "device": str(device),
            "batch_scale": args.batch_scale,
            "dtype": "float32",
            "rounds": args.rounds,
            "settle": args.settle,
            "steps_per_turn": args.steps_per_turn,
            "step": "loss(module(*inputs)).backward(), loss from the zoo case; grads set to None "
            "before each step",
            "peak": "memfit.measure of one step after two warm-up steps ("
            + (
                "exact CPU allocator accounting, deterministic)"
                if device.type == "cpu"
                else "CUDA caching allocator statistics)"
            ),
            "time": "median of `rounds` x `steps_per_turn` steps timed by "
            "memfit.measure(profile_memory=False) (no profiler), in turns of `settle` untimed "
            "steps then `steps_per_turn` timed ones, round-robin over all of a model's points, "
            "start rotated each round; gc.collect() before each step, gc disabled during a round, "
            "the objects alive when the timing began frozen (gc.freeze) until it ends; "
            "faults: the process's minor page faults during each timed step",
            "torch.compile": "inductor; torch._functorch.config.activation_memory_budget patched "
            "around compilation and the whole first step; each point its own "
            "code object (no dynamo reset between points)",
            "torch_compile_budgets": list(args.compile_budgets),
            "checkpoint_sequential": "eager, model.blocks, every segment count, "
            "use_reentrant=False (the last segment is not checkpointed)",
            "memfit_budgets": list(args.memfit_budgets),
            "memfit_budget_meaning": "fraction of plain autograd's predicted activation peak; "
            "an int is bytes (the smallest feasible)",
            "memfit_modes": list(args.memfit_modes),
            "memfit_executor": args.executor,
            "memfit_autotune": args.autotune,
            "timing_lock": (
                "run in parallel with other models' runs: compiled alongside them, timed alone "
                "once none was compiling"
                if args.lock
                else None
            ),
            "equal_peak_tolerance": PEAK_TOLERANCE,
            "recompute_flops": "see each point's recompute_flops_method; peers count "
            "matmul/conv/attention only (FlopCounterMode formulas + CPU flash "
            "attention), memfit adds 1 FLOP per element of other ops",
        },
        "load_average": {"start": load_start, "end": load_average()},
        "total_runtime_s": round(total, 1),
        "models": results,
    }
    for res in results:
        res["pareto_front"] = [f"{r['peer']} {r['setting']}" for r in pareto_front(res["points"])]
        res["equal_peak"] = equal_peak_comparison(res["points"], args.steps_per_turn)
        res["same_program"] = same_program_pairs(res["points"], args.steps_per_turn)
    json_path = stem.with_suffix(".json")
    json_path.write_text(json.dumps(report, indent=2) + "\n")

    cpu = report["machine"].get("cpu_model", report["machine"]["processor"])
    sections, all_losses = [], []
    for res in results:
        title = f"{res['name']}: {res['description']}"
        png = args.out_dir / f"{stem.name}_{res['name']}.png"
        write_plot(res, png, title)
        table, losses = comparison_table(res, args.steps_per_turn)
        all_losses += losses
        recompiles = res["graphs_compiled_during_measurement"]
        sections.append(
            f"## {res['name']}\n\n{res['description']}; {res['parameters']:,} parameters. "
            f"checkpoint_sequential: {res['checkpoint_sequential']}. "
            f"{res['seconds']:.0f} s for this model"
            + (f"; WARNING: {recompiles} graphs compiled during measurement" if recompiles else "")
            + ".\n\n"
            f"![{res['name']}]({png.name})\n\n"
            f"### Every point\n\n{points_table(res)}\n\n"
            f"### memfit against the fastest peer at equal measured peak\n\n{table}\n\n"
            f"{same_program_text(res['same_program'])}\n"
        )
    verdict = (
        "memfit is slower than a peer at equal peak in these rows:\n\n"
        + "\n".join(f"- {x}" for x in all_losses)
        if all_losses
        else "memfit is no slower than either peer at equal measured peak in every row."
    )
    md = (
        f"# Budget frontier ({report['date_utc']})\n\n"
        + (
            f"CPU ({cpu})"
            if device.type == "cpu"
            else f"{report['machine']['gpu']} ({device}; peaks from the caching allocator's "
            f"statistics; batch x{args.batch_scale}), host CPU {cpu}"
        )
        + f", torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, load average "
        f"{load_start} at start and {report['load_average']['end']} at end. Peak is the "
        f"measured tensor memory of one training step ("
        + ("exact allocator accounting" if device.type == "cpu" else "the allocator's counters")
        + f"); step time "
        f"is the median of {args.rounds * args.steps_per_turn} steps, {args.rounds} turns per "
        f"point interleaved across all points of a model, each turn {args.settle} untimed "
        f"step(s) then {args.steps_per_turn} timed "
        f"(interquartile range in brackets; page faults: median minor page faults per timed "
        f'step); ratios are to plain eager; "own baseline" is the '
        f'same peer recomputing nothing (memfit "none", torch.compile at budget 1.0, eager), '
        f"which separates the cost of recomputation from the speed of each executor. "
        f"Recomputed GFLOP: memfit from its plan "
        f"(includes 1 FLOP per element of elementwise ops), peers from FlopCounterMode formulas "
        f"(matmul/conv/attention only) as the step's total minus eager's. \"Pareto\" marks the "
        f"points no other point beats on both peak and time. In the comparison, a ratio above 1 "
        f'(bold) means memfit is slower than the peer. In the summary, "fastest steps" takes '
        f"each point's fastest timed step instead of its median (noise only lengthens steps); "
        f'"one program pooled" compares programs instead of settings: the steps of the '
        f"settings that ran one program (torch.compile: the same graphs compiled; memfit: the "
        f"same plan) pooled into one median, on both sides (the least of several medians of one "
        f'program is lower than its time, the greatest higher); "turn by turn" compares those '
        f"programs step k against step k (the k-th steps of all points ran in one turn), the "
        f"median of those ratios, so that what the machine's speed drifts between turns "
        f'divides out; its 95% interval is a bootstrap over turns, and "slower beyond '
        f'noise" counts the memfit points whose interval lies wholly above 1. '
        f"Total runtime {total:.0f} s.\n\n"
        f"## Summary: memfit at equal measured peak\n\n"
        f"{summary_table(results, args.steps_per_turn)}\n\n"
        f"{verdict}\n\n" + "\n".join(sections)
    )
    stem.with_suffix(".md").write_text(md)
    print()
    print(md)
    print(
        f"wrote {json_path}, {stem.with_suffix('.md')} and "
        f"{len(results)} PNGs in {total:.0f} s total"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
