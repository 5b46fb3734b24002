"""The plan: plain data between planning and execution, and what a user reads after a step.

A model captured with graph breaks has one joint graph per piece; each gets a ``GraphPlan`` and the
``Plan`` sums them. A ``GraphPlan`` has two parts. ``decisions`` is the contract with execution: a
``Decision`` for every forward value the backward reads (named as in the captured joint graph), and
the executor builds the forward and backward graphs from it and from nothing else. The rest is the
report of that same decision on that same graph (what is kept, what is recomputed, the simulated
peak), computed once by the planner. Everything here is numbers and names, so a plan can be
printed, compared, serialised or asserted on without touching a graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from memfit.planning.decision import Decision
from memfit.units import format_bytes

if TYPE_CHECKING:
    from memfit.capture.attention import AttentionSite

__all__ = ["GraphPlan", "ParetoPoint", "Plan", "TransferPlan"]


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
class ParetoPoint:
    """One plan on the (peak memory, recompute cost) frontier, as predicted by the simulator."""

    peak_bytes: int
    recompute_flops: int
    recompute_seconds: float
    kept_bytes: int = 0
    #: bytes offloaded and the predicted seconds compute waits for the link (offload plans)
    offloaded_bytes: int = 0
    stall_seconds: float = 0.0


@dataclass(frozen=True)
class GraphPlan:
    """What one captured graph keeps and recomputes, and its predicted memory.

    ``decisions`` maps the name of every forward value the backward reads, directly or to
    recompute another value from, to its ``Decision``; step inputs the backward reads (parameters,
    the batch) are ``SAVE`` at no cost. The other fields report that decision: ``kept`` are the
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
    #: the byte budget this graph was planned against (``"budget"`` policy only)
    budget_bytes: int | None = None
    #: with graph breaks, once the step was planned as a whole: the whole step's budget, of
    #: which ``budget_bytes`` is this graph's share (``planning.step``)
    step_budget_bytes: int | None = None
    #: the graph's simulated Pareto frontier, by increasing peak (``"budget"`` policy only)
    frontier: tuple[ParetoPoint, ...] = ()
    #: Every attention the capture pass found in this graph, and the kernel it now runs.
    attention: tuple[AttentionSite, ...] = ()
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
    #: identifies the captured graph and its input shapes, so a measurement made while one
    #: plan ran reaches the next plan of the same graph
    key: str = ""

    def saved(self) -> list[str]:
        """Names of the values decided ``SAVE``, in the order the decisions were made."""
        return [name for name, d in self.decisions.items() if d is Decision.SAVE]

    @property
    def offloaded(self) -> tuple[str, ...]:
        return tuple(t.value for t in self.transfers)

    @property
    def offloaded_bytes(self) -> int:
        return sum(t.nbytes for t in self.transfers)


@dataclass(frozen=True)
class Plan:
    """The plan of a whole model: one ``GraphPlan`` per captured graph.

    ``predicted_peak_bytes`` is the predicted peak of activation memory of one training step
    (forward + backward) above what was live before it, the quantity ``memfit.measure`` reports.
    With several graphs (graph breaks), earlier graphs' kept values stay alive while later graphs
    run, so the prediction is the sum of what every graph keeps plus the largest transient on top.
    """

    policy: str
    graphs: tuple[GraphPlan, ...] = field(default_factory=tuple)

    @property
    def kept(self) -> tuple[str, ...]:
        return tuple(name for g in self.graphs for name in g.kept)

    @property
    def recomputed(self) -> tuple[str, ...]:
        return tuple(name for g in self.graphs for name in g.recomputed)

    @property
    def attention(self) -> tuple[AttentionSite, ...]:
        """Every attention found (module and line), the kernel chosen, or why it was left alone."""
        return tuple(site for g in self.graphs for site in g.attention)

    @property
    def kept_bytes(self) -> int:
        return sum(g.kept_bytes for g in self.graphs)

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
        return sum(g.recompute_flops for g in self.graphs)

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
        whole, the whole step's; before that, the first graph's."""
        if not self.graphs:
            return None
        first = self.graphs[0]
        return (
            first.step_budget_bytes if first.step_budget_bytes is not None else first.budget_bytes
        )

    def pareto(self) -> list[ParetoPoint]:
        """The (predicted peak, recompute cost) frontier, by increasing peak.

        Only plans made with a budget carry a frontier (``memfit.plan`` always does). With graph
        breaks, the k-th point combines each graph's point at the same relative position of its
        own frontier, summed the way ``predicted_peak_bytes`` sums graphs.
        """
        if not self.graphs or any(not g.frontier for g in self.graphs):
            raise ValueError(
                f"this plan ({self.policy!r}) has no frontier: plan with a budget, "
                f"e.g. memfit.plan(model, *inputs, budget=1.0) or checkpoint(model, budget=0.5)"
            )
        if len(self.graphs) == 1:
            return list(self.graphs[0].frontier)
        count = max(len(g.frontier) for g in self.graphs)
        points = []
        for k in range(count):
            picked = [
                g.frontier[round(k * (len(g.frontier) - 1) / max(count - 1, 1))]
                for g in self.graphs
            ]
            points.append(
                ParetoPoint(
                    peak_bytes=self._combine(
                        [p.peak_bytes for p in picked], [p.kept_bytes for p in picked]
                    ),
                    recompute_flops=sum(p.recompute_flops for p in picked),
                    recompute_seconds=sum(p.recompute_seconds for p in picked),
                    kept_bytes=sum(p.kept_bytes for p in picked),
                    offloaded_bytes=sum(p.offloaded_bytes for p in picked),
                    stall_seconds=sum(p.stall_seconds for p in picked),
                )
            )
        return sorted(points, key=lambda p: p.peak_bytes)

    @property
    def forward_flops(self) -> int:
        return sum(g.forward_flops for g in self.graphs)

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
        per bucket, and a prediction without them was 3.4x low)."""
        graphs = self.graphs
        if len(graphs) == 1:
            return graphs[0].predicted_peak_bytes
        if any(g.forward_peak_bytes == 0 and g.backward_peak_bytes == 0 for g in graphs):
            return self._combine(  # plans made without their forward and backward apart
                [g.predicted_peak_bytes for g in graphs], [g.kept_bytes for g in graphs]
            )
        later = [0] * (len(graphs) + 1)
        for i in range(len(graphs) - 1, -1, -1):
            later[i] = later[i + 1] + graphs[i].parameter_grad_bytes
        peak = before = 0
        for i, g in enumerate(graphs):
            peak = max(
                peak,
                before + g.forward_peak_bytes,
                before + later[i + 1] + g.backward_peak_bytes,
            )
            before += g.kept_bytes + g.output_bytes
        return peak

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
            f"  ({ratio:.0%} of {format_bytes(base)} without checkpointing)",
            f"  kept for backward {format_bytes(self.kept_bytes)} in {len(self.kept)} tensors",
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
        if self.budget_bytes is not None:
            lines.insert(1, f"  budget            {format_bytes(self.budget_bytes)}")
        for i, g in enumerate(self.graphs):
            if g.note:
                lines.append(f"  graph {i}: {g.note}")
        return "\n".join(lines)
