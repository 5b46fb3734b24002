"""The plan: plain data between planning and execution, and what a user reads after a step.

A model captured with graph breaks has one joint graph per piece; each gets a ``GraphPlan`` and the
``Plan`` sums them. A ``GraphPlan`` has two parts. ``decisions`` is the contract with execution: a
``Decision`` for every forward value the backward reads (named as in the captured joint graph), and
the executor builds the forward and backward graphs from it and from nothing else. The rest is the
report of that same decision on that same graph (what is kept, what is recomputed, the simulated
peak), computed once by the planner. Everything here is numbers and names, so a plan can be
printed, compared, serialised or asserted on without touching a graph.

A submodule Dynamo could not capture whole (a graph break inside it) may be recomputed whole in
the backward pass, its Python run again (``execution.regions``); each such call is a
``RegionPlan`` naming the module and the graphs that ran inside it, and the ``Plan``'s sums count
it as the checkpoint runs it: its inputs kept, its graphs' kept values alive only while it is
recomputed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from memfit.capture.attention import AttentionSite
from memfit.capture.loss_head import LossHeadSite
from memfit.planning.decision import Decision
from memfit.planning.plan_chain import ChainSummary
from memfit.units import format_bytes

__all__ = ["GraphPlan", "FrontierPoint", "Plan", "RegionPlan", "TransferPlan", "sized_key"]


def sized_key(key: str, sizes: tuple[tuple[str, int], ...]) -> str:
    """A graph's ``key`` with the values of its size symbols (``key`` alone where static)."""
    return key if not sizes else key + "@" + ",".join(f"{name}={value}" for name, value in sizes)


@dataclass(frozen=True)
class TransferPlan:
    """Where the executor moves one offloaded value (names as in the captured joint graph).

    The copy out starts when ``value`` is produced and is waited for after the forward node
    ``wait_after`` (the device copy dies there); the copy back starts before the backward node
    ``prefetch_before``.
    """

    value: str
    nbytes: int
    wait_after: str
    prefetch_before: str


@dataclass(frozen=True)
class FrontierPoint:
    """One plan on the (peak memory, recompute cost) frontier, as predicted by the simulator."""

    peak_bytes: int
    recompute_flops: int
    recompute_seconds: float
    kept_bytes: int = 0
    #: bytes offloaded and the predicted seconds compute waits for the link (offload plans)
    offloaded_bytes: int = 0
    stall_seconds: float = 0.0
    #: under Inductor, the traffic of what it keeps (``analysis.cost.keeping_seconds``)
    keep_seconds: float = 0.0

    @property
    def cost_seconds(self) -> float:
        """What the plan adds to a step, as ``Candidate.cost_seconds``."""
        return self.recompute_seconds + self.stall_seconds + self.keep_seconds


@dataclass(frozen=True)
class GraphPlan:
    """What one captured graph keeps and recomputes, and its predicted memory.

    ``decisions`` maps the name of every forward value the backward reads, directly or to
    recompute another value from, to its ``Decision``; step inputs the backward reads (parameters,
    the batch) are ``KEEP`` at no cost. The other fields report that decision: ``kept`` are the
    saved values that cost memory (not step inputs, not the step's own outputs, which are alive
    anyway), ``recomputed`` the forward ops the backward runs again.
    """

    policy: str
    decisions: dict[str, Decision]
    kept: tuple[str, ...]
    recomputed: tuple[str, ...]
    kept_bytes: int
    predicted_peak_bytes: int
    baseline_peak_bytes: int
    baseline_kept_bytes: int
    recompute_flops: int
    forward_flops: int
    num_nodes: int
    note: str = ""
    #: estimated time of the recomputation (roofline of FLOPs and bytes; ``analysis.cost``)
    recompute_seconds: float = 0.0
    #: under Inductor, the traffic of what it keeps (``analysis.cost.keeping_seconds``)
    keep_seconds: float = 0.0
    #: the byte budget this graph was planned against (``"budget"`` policy only)
    budget_bytes: int | None = None
    #: with graph breaks, once the step was planned as a whole: the whole step's budget, of
    #: which ``budget_bytes`` is this graph's share (``planning.step_budget``)
    step_budget_bytes: int | None = None
    #: the graph's simulated Pareto frontier, by increasing peak (``"budget"`` policy only)
    frontier: tuple[FrontierPoint, ...] = ()
    #: Every attention the capture pass found in this graph, and the kernel it now runs.
    attention: tuple[AttentionSite, ...] = ()
    #: Every loss head (``cross_entropy(linear(h))``) the capture pass found in this graph, and
    #: whether it now runs memfit's chunked kernel.
    loss_heads: tuple[LossHeadSite, ...] = ()
    #: the values decided ``OFFLOAD`` and where the executor moves them, in issue order
    transfers: tuple[TransferPlan, ...] = ()
    #: ``"host"`` or ``"disk"`` when anything is offloaded
    offload_to: str | None = None
    #: seconds the link is busy (out and in), and the predicted seconds compute waits for it
    transfer_seconds: float = 0.0
    stall_seconds: float = 0.0
    #: bytes alive when the forward ends, predicted
    forward_end_bytes: int = 0
    #: the predicted peaks of the forward and of the backward, apart (0: not known)
    forward_peak_bytes: int = 0
    backward_peak_bytes: int = 0
    #: bytes of the graph's outputs (alive while later graphs of a step run) and of the
    #: gradients it returns for parameters (alive while earlier graphs' backwards run)
    output_bytes: int = 0
    parameter_grad_bytes: int = 0
    #: bytes the step was measured to hold outside the graph between its forward and backward
    #: (a loss computed outside the model), reserved in ``predicted_peak_bytes``; 0: none known
    outside_bytes: int = 0
    #: the graph returns a scalar with a gradient: the model computes its own loss
    returns_loss: bool = False
    #: identifies the captured graph and its input shapes, so a measurement made while one
    #: plan ran reaches the next plan of the same graph
    key: str = ""
    #: Symbolic sizes (a graph captured for a range of input sizes): the values of its size
    #: symbols this plan's numbers are for (the call that ran), the values its decisions were
    #: chosen at, and the range of each symbol the decisions are used for (``None``: no bound).
    #: All empty for a graph with static shapes.
    sizes: tuple[tuple[str, int], ...] = ()
    planned_sizes: tuple[tuple[str, int], ...] = ()
    size_range: tuple[tuple[str, int, int | None], ...] = ()

    @property
    def sized_key(self) -> str:
        """``key`` and, for a graph with symbolic sizes, the sizes these numbers are for: what
        a step's budget is shared by (``planning.step_budget``), since a share holds at one size."""
        return sized_key(self.key, self.sizes)

    def saved(self) -> list[str]:
        """Names of the values decided ``KEEP``, in the order the decisions were made."""
        return [name for name, d in self.decisions.items() if d is Decision.KEEP]

    def keeps_fraction(self, fraction: float) -> bool:
        """Whether this plan keeps at most ``fraction`` of the activations plain autograd keeps:
        what a budget fraction promises where plain autograd's peak less the activations it
        gives up lies below every plan (``planning.planner``'s ``_fraction_reach``)."""
        return self.kept_bytes <= fraction * self.baseline_kept_bytes

    @property
    def offloaded(self) -> tuple[str, ...]:
        return tuple(t.value for t in self.transfers)

    @property
    def offloaded_bytes(self) -> int:
        return sum(t.nbytes for t in self.transfers)

    @property
    def cost_seconds(self) -> float:
        """What the plan adds to a step in the planner's estimate (``FrontierPoint``'s)."""
        return self.recompute_seconds + self.stall_seconds + self.keep_seconds


@dataclass(frozen=True)
class RegionPlan:
    """One call of a submodule recomputed whole in the backward pass (``execution.regions``).

    Dynamo could not capture the module's forward as one graph, so its calls run as
    ``torch.utils.checkpoint`` runs a function (``use_reentrant=False``): only its inputs are
    kept, and the backward runs its Python again, memfit's graphs inside it included, with the
    random state of the forward and its buffers put back afterwards. ``graphs`` are the indices
    in ``Plan.graphs`` of the graphs that ran inside this call; what its Python allocates outside
    them is not predicted.
    """

    #: the module, named as in ``named_modules()``
    module: str
    #: its class, and where its ``forward`` is defined (``file:line``)
    kind: str
    where: str
    #: bytes of the inputs the checkpoint keeps (tensors autograd made, one count per storage)
    input_bytes: int
    graphs: tuple[int, ...] = ()


@dataclass(frozen=True)
class Plan:
    """The plan of a whole model: one ``GraphPlan`` per captured graph.

    ``predicted_peak_bytes`` is the predicted peak of activation memory of one training step
    (forward + backward) above what was live before it, the quantity ``memfit.measure`` reports.
    With several graphs (graph breaks), the graphs run in order (``predicted_peak_bytes``); a
    region (``RegionPlan``) is one part of that order (``region_part``), whose graphs keep their
    values only while the backward recomputes it. Not predicted: what the model's Python outside
    memfit's graphs allocates (in a region, its eager code runs twice); ``str(plan)`` says so.
    """

    policy: str
    graphs: tuple[GraphPlan, ...] = field(default_factory=tuple)
    #: calls of submodules recomputed whole, in the order they ran (graph breaks inside them)
    regions: tuple[RegionPlan, ...] = ()
    #: with graph breaks, the runs dropped in the forward and replayed in the backward, and the
    #: step's peak that follows (``planning.plan_chain``); None: each graph keeps what it keeps
    chain: ChainSummary | None = None
    #: with graph breaks, measured on an earlier step: per part (``parts``), the bytes the step
    #: held when the part's forward started beyond what the parts before it predict (``starts``).
    #: The model's Python between graphs holds what no graph sees (tensors eager autograd saves
    #: for its own backward, SpecAugment's masks: +49.5 KB under tiny wav2vec2's encoder) and
    #: may drop a graph's outputs the parts before count (negative). Empty: not measured.
    held: tuple[int, ...] = ()

    def outside_regions(self) -> list[GraphPlan]:
        """The graphs that ran outside every region, in order (those a step budget shares)."""
        inside = {i for r in self.regions for i in r.graphs}
        return [g for i, g in enumerate(self.graphs) if i not in inside]

    def _region_graphs(self, region: RegionPlan) -> list[GraphPlan]:
        return [self.graphs[i] for i in region.graphs]

    def parts(self) -> list[GraphPlan]:
        """The step's parts in the order they run: each graph outside a region, and in place of
        a region's graphs one summary of the region (``region_part``)."""
        starts = {r.graphs[0]: r for r in self.regions if r.graphs}
        inside = {i for r in self.regions for i in r.graphs}
        parts = []
        for i, g in enumerate(self.graphs):
            if i in starts:
                parts.append(self.region_part(starts[i]))
            elif i not in inside:
                parts.append(g)
        return parts

    def part_firsts(self) -> list[int]:
        """Index in ``graphs`` of each part's first graph (``parts``), in run order: where a
        part's forward starts in the call."""
        starts = {r.graphs[0] for r in self.regions if r.graphs}
        inside = {i for r in self.regions for i in r.graphs}
        return [i for i in range(len(self.graphs)) if i in starts or i not in inside]

    def starts(self) -> list[int]:
        """Bytes predicted alive when each part's forward starts, from the parts alone: what the
        parts before it keep and output (``held`` not added)."""
        out, before = [], 0
        for g in self.parts():
            out.append(before)
            before += g.kept_bytes + g.output_bytes
        return out

    def with_levels(self, levels: list[int]) -> Plan:
        """This plan with ``held`` measured: ``levels`` are the bytes live (above the call's
        start) when each graph of ``graphs`` started its forward, in run order."""
        if len(levels) != len(self.graphs) or len(self.graphs) < 2:
            return self
        raw = [levels[i] - s for i, s in zip(self.part_firsts(), self.starts())]
        # A region's first graph starts after the region's own Python ran, which its checkpoint
        # keeps nothing of: what the step holds through a region is at most what is still held
        # when the part after it starts.
        regions = {r.graphs[0] for r in self.regions if r.graphs}
        held = tuple(
            min(h, raw[k + 1]) if first in regions and k + 1 < len(raw) else h
            for k, (first, h) in enumerate(zip(self.part_firsts(), raw))
        )
        return dataclasses.replace(self, held=held)

    def region_part(self, region: RegionPlan) -> GraphPlan:
        """One region call as a part of the step, in ``GraphPlan``'s terms.

        Its forward keeps nothing (the checkpoint keeps only the inputs, which the parts before
        it output and are counted there); while it runs, its graphs' outputs are alive and their
        kept values are dropped as they are made. Its backward starts by running its graphs
        again, which then keep what they keep: its backward peak is that of its graphs as a step
        of their own. It outputs what its last graph outputs.
        """
        inner = self._region_graphs(region)
        own = Plan(self.policy, tuple(inner))
        backward = own.predicted_peak_bytes
        if all(g.forward_peak_bytes for g in inner):
            outputs = [sum(g.output_bytes for g in inner[:i]) for i in range(len(inner))]
            forward = max(o + g.forward_peak_bytes for o, g in zip(outputs, inner))
        else:
            forward = backward
        return GraphPlan(
            policy="region",
            decisions={},
            kept=(),
            recomputed=(),
            kept_bytes=0,
            predicted_peak_bytes=max(forward, backward),
            baseline_peak_bytes=own.baseline_peak_bytes,
            baseline_kept_bytes=own.baseline_kept_bytes,
            recompute_flops=sum(g.forward_flops + g.recompute_flops for g in inner),
            forward_flops=sum(g.forward_flops for g in inner),
            num_nodes=sum(g.num_nodes for g in inner),
            note=f"{region.module} recomputed whole",
            forward_end_bytes=inner[-1].output_bytes if inner else 0,
            forward_peak_bytes=forward,
            backward_peak_bytes=backward,
            output_bytes=inner[-1].output_bytes if inner else 0,
            parameter_grad_bytes=sum(g.parameter_grad_bytes for g in inner),
            key=f"region {region.module} @{region.graphs[0] if region.graphs else 0}",
        )

    @property
    def kept(self) -> tuple[str, ...]:
        """Values the graphs keep for backward (graphs inside a region keep theirs only while
        the region is recomputed: not listed)."""
        return tuple(name for g in self.outside_regions() for name in g.kept)

    @property
    def recomputed(self) -> tuple[str, ...]:
        return tuple(name for g in self.graphs for name in g.recomputed)

    @property
    def attention(self) -> tuple[AttentionSite, ...]:
        """Every attention found (module and line), the kernel chosen, or why it was left alone."""
        return tuple(site for g in self.graphs for site in g.attention)

    @property
    def loss_heads(self) -> tuple[LossHeadSite, ...]:
        """Every loss head found (module and line), rewritten or why it was left alone."""
        return tuple(site for g in self.graphs for site in g.loss_heads)

    @property
    def kept_bytes(self) -> int:
        """Bytes kept from forward to backward: the graphs' kept values, and each region's
        inputs instead of what its graphs keep."""
        return sum(g.kept_bytes for g in self.outside_regions()) + sum(
            r.input_bytes for r in self.regions
        )

    @property
    def offloaded(self) -> tuple[str, ...]:
        """Values copied off the device between their forward and their backward."""
        return tuple(name for g in self.graphs for name in g.offloaded)

    @property
    def offloaded_bytes(self) -> int:
        return sum(g.offloaded_bytes for g in self.graphs)

    @property
    def host_peak_bytes(self) -> int:
        """Most bytes held off the device at once (host memory or disk): every offloaded value of
        the step is out between the end of its forward and its reload."""
        return self.offloaded_bytes

    @property
    def transfer_seconds(self) -> float:
        return sum(g.transfer_seconds for g in self.graphs)

    @property
    def stall_seconds(self) -> float:
        return sum(g.stall_seconds for g in self.graphs)

    @property
    def offload_to(self) -> str | None:
        return next((g.offload_to for g in self.graphs if g.offload_to), None)

    @property
    def recompute_flops(self) -> int:
        """FLOPs the backward runs again: each graph's recomputation, and each region's whole
        forward (its graphs' FLOPs; its eager ops are not counted)."""
        regions = sum(g.forward_flops for r in self.regions for g in self._region_graphs(r))
        return sum(g.recompute_flops for g in self.graphs) + regions

    @property
    def outside_bytes(self) -> int:
        """Bytes measured outside memfit's graphs between forward and backward, reserved."""
        return sum(g.outside_bytes for g in self.graphs)

    @property
    def recompute_seconds(self) -> float:
        return sum(g.recompute_seconds for g in self.graphs)

    @property
    def budget_bytes(self) -> int | None:
        """The byte budget of the step: with graph breaks, once the step was planned as a
        whole, the whole step's; before that, the first graph's. Graphs inside regions are
        planned without a budget: None when every graph ran inside one."""
        planned = self.outside_regions()
        if not planned:
            return None
        first = planned[0]
        return (
            first.step_budget_bytes if first.step_budget_bytes is not None else first.budget_bytes
        )

    def pareto(self) -> list[FrontierPoint]:
        """The (predicted peak, recompute cost) frontier, by increasing peak.

        Only plans made with a budget carry a frontier (``memfit.plan(model, *inputs, policy=1.0)``
        gives one for any model). With graph
        breaks, the k-th point combines each graph's point at the same relative position of its
        own frontier, summed the way ``predicted_peak_bytes`` sums graphs; a region (planned
        without a budget) is the same part of every point, its FLOPs counted, not its seconds.
        """
        graphs = self.outside_regions()
        if not self.graphs or any(not g.frontier for g in graphs):
            raise ValueError(
                f"this plan ({self.policy!r}) has no frontier: plan with a budget, "
                f"e.g. memfit.plan(model, *inputs, policy=1.0) or memfit.checkpoint(model, 0.5)"
            )
        if len(graphs) == 1 and not self.regions:
            return list(graphs[0].frontier)
        fixed = [
            # the same in every point; only FLOPs are known for a region's forward, not seconds
            FrontierPoint(part.predicted_peak_bytes, part.recompute_flops, 0.0, 0)
            for part in (self.region_part(r) for r in self.regions)
        ]
        count = max((len(g.frontier) for g in graphs), default=1)
        points = []
        for k in range(count):
            picked = [
                g.frontier[round(k * (len(g.frontier) - 1) / max(count - 1, 1))] for g in graphs
            ] + fixed
            points.append(
                FrontierPoint(
                    peak_bytes=self._combine(
                        [p.peak_bytes for p in picked], [p.kept_bytes for p in picked]
                    ),
                    recompute_flops=sum(p.recompute_flops for p in picked),
                    recompute_seconds=sum(p.recompute_seconds for p in picked),
                    kept_bytes=sum(p.kept_bytes for p in picked),
                    offloaded_bytes=sum(p.offloaded_bytes for p in picked),
                    stall_seconds=sum(p.stall_seconds for p in picked),
                    keep_seconds=sum(p.keep_seconds for p in picked),
                )
            )
        return sorted(points, key=lambda p: p.peak_bytes)

    @property
    def forward_flops(self) -> int:
        return sum(g.forward_flops for g in self.graphs)

    @property
    def sizes(self) -> dict[str, int]:
        """The values of the graphs' size symbols this plan's numbers are for (the call that
        ran); empty where every graph has static shapes."""
        return {name: value for g in self.graphs for name, value in g.sizes}

    @staticmethod
    def _combine(peaks: list[int], kept: list[int]) -> int:
        if not peaks:
            return 0
        return sum(kept) + max(p - k for p, k in zip(peaks, kept))

    @property
    def predicted_peak_bytes(self) -> int:
        """With graph breaks, the graphs' forwards run in order and their backwards in reverse:
        while graph ``g`` runs, the graphs before it hold what they keep and their outputs, and
        in its backward the graphs after it have left their parameters' gradients (``.grad``
        outlives the graph that made it; measured: DDP's optimizer splits a model into one graph
        per bucket, and a prediction without them was 3.4x low). A region is one part of that
        order (``parts``). Where the graphs were planned as a chain, the chain's simulation of the
        step (``planning.plan_chain``)."""
        if self.chain is not None:
            return self.chain.peak_bytes
        graphs = self.parts()
        if len(graphs) == 1:
            return graphs[0].predicted_peak_bytes
        if any(g.forward_peak_bytes == 0 and g.backward_peak_bytes == 0 for g in graphs):
            return self._combine(  # plans made without their forward and backward apart
                [g.predicted_peak_bytes for g in graphs], [g.kept_bytes for g in graphs]
            )
        later = [0] * (len(graphs) + 1)
        for i in range(len(graphs) - 1, -1, -1):
            later[i] = later[i + 1] + graphs[i].parameter_grad_bytes
        held = self.held if len(self.held) == len(graphs) else (0,) * len(graphs)
        peak = 0
        for i, (g, start) in enumerate(zip(graphs, self.starts())):
            before = max(0, start + held[i])
            peak = max(
                peak,
                before + g.forward_peak_bytes,
                before + later[i + 1] + g.backward_peak_bytes,
            )
        return peak

    @property
    def forward_end_bytes(self) -> int:
        """Bytes predicted alive when the step's last forward ends: what the parts before the
        last keep (a region: its inputs), and the last part's own end; of a chain, what its runs
        hold."""
        if self.chain is not None:
            return self.chain.held_bytes
        parts = self.parts()
        if not parts:
            return 0
        if len(self.held) == len(parts):  # measured: what the step held when the last started
            return max(0, self.starts()[-1] + self.held[-1]) + parts[-1].forward_end_bytes
        return self.kept_bytes - parts[-1].kept_bytes + parts[-1].forward_end_bytes

    @property
    def baseline_kept_bytes(self) -> int:
        """Activations plain autograd keeps for backward (what a budget fraction divides)."""
        return sum(g.baseline_kept_bytes for g in self.graphs)

    @property
    def baseline_peak_bytes(self) -> int:
        """The predicted peak of the same capture with nothing recomputed (``"none"``)."""
        return self._combine(
            [g.baseline_peak_bytes for g in self.graphs],
            [g.baseline_kept_bytes for g in self.graphs],
        )

    def __str__(self) -> str:
        base = self.baseline_peak_bytes
        ratio = self.predicted_peak_bytes / base if base else 1.0
        extra = self.recompute_flops / self.forward_flops if self.forward_flops else 0.0
        lines = [
            f"memfit plan ({self.policy!r}, {len(self.graphs)} graph"
            f"{'s' if len(self.graphs) != 1 else ''})",
            f"  predicted peak    {format_bytes(self.predicted_peak_bytes)}"
            f"  ({ratio:.0%} of the {format_bytes(base)} memfit predicts keeping everything)",
            f"  kept for backward {format_bytes(self.kept_bytes)} in {len(self.kept)} tensors"
            + (f" and the inputs of {len(self.regions)} regions" if self.regions else ""),
            f"  recomputed        {len(self.recomputed)} ops, {self.recompute_flops:.3g} FLOPs"
            f" ({extra:.0%} of one forward)",
        ]
        if self.offloaded:
            lines.append(
                f"  offloaded         {format_bytes(self.offloaded_bytes)} in "
                f"{len(self.offloaded)} tensors to {self.offload_to}; link busy "
                f"{self.transfer_seconds * 1e3:.3g} ms, predicted stall "
                f"{self.stall_seconds * 1e3:.3g} ms"
            )
        if self.outside_bytes:
            lines.append(
                f"  outside memfit    {format_bytes(self.outside_bytes)} between forward and "
                f"backward (measured on an earlier step; included in the predicted peak)"
            )
        if self.chain is not None and self.chain.segments:
            c = self.chain
            lines[2] = (
                f"  kept for backward {format_bytes(c.held_bytes)} held from forward to backward "
                f"(the values entering each dropped segment, and what runs not dropped keep)"
            )
            extra = c.replay_flops / c.forward_flops if c.forward_flops else 0.0
            shown = ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in c.segments[:6])
            more = ", ..." if len(c.segments) > 6 else ""
            lines.append(
                f"  across breaks     {c.replayed} of {c.runs} graph runs dropped in "
                f"{len(c.segments)} segments (runs {shown}{more}) and replayed in the backward "
                f"({extra:.0%} of one forward again); only the values entering each segment "
                f"are kept; {format_bytes(c.keep_all_peak_bytes)} if everything were kept"
            )
        if self.regions:
            calls = f"{len(self.regions)} call{'s' if len(self.regions) > 1 else ''}"
            lines.append(
                f"  recomputed whole  {calls} of {_region_names(self.regions)} "
                f"(graph breaks inside): inputs kept, Python re-run in backward; what it "
                f"allocates outside memfit's graphs is not in the prediction"
            )
        if self.budget_bytes is not None:
            lines.insert(1, f"  budget            {format_bytes(self.budget_bytes)}")
        for i, g in enumerate(self.graphs):
            if g.sizes and g.sizes != g.planned_sizes:
                at = ", ".join(f"{name}={value}" for name, value in g.sizes)
                chosen = ", ".join(f"{name}={value}" for name, value in g.planned_sizes)
                lines.append(f"  graph {i}: predicted at {at}; decisions chosen at {chosen}")
            if g.note:
                lines.append(f"  graph {i}: {g.note}")
        return "\n".join(lines)


def _region_names(regions: tuple[RegionPlan, ...], shown: int = 3) -> str:
    """``layers.0, layers.1, ... layers.7 (Layer, file.py:12)``: the modules, each once."""
    names = list(dict.fromkeys(r.module for r in regions))
    listed = ", ".join(names) if len(names) <= shown else f"{', '.join(names[:2])}, ... {names[-1]}"
    kinds = "; ".join(dict.fromkeys(f"{r.kind} at {r.where}" for r in regions))
    return f"{listed} ({kinds})"
