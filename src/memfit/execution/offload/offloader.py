"""The offload side of one memfit wrapper (``Offloader``): its options, its stores, and the link
and byte limit each graph is planned to offload with.

Part of ``memfit.execution.offload``: see its docstring. The wrapper (``execution.planned_call``)
makes one; the partitioner asks it, per joint graph, where values go and how fast, and has it
reserve host memory for the plan; the backend counts what each step's graphs offload against it.
"""

from __future__ import annotations

from memfit._compat import disable_current_modes
from memfit.analysis.graph import JointGraph, activation_device
from memfit.analysis.transfers import Link
from memfit.execution.offload.link import copy_overlap, measure_link
from memfit.execution.offload.offload_options import OffloadOptions
from memfit.execution.offload.store import OffloadStore
from memfit.planning.plan import GraphPlan

__all__ = ["Offloader"]


class Offloader:
    """The offload side of one wrapper: its options, its stores and the link it plans with.

    A store is made when the first graph offloading to its destination is planned (the
    destination depends on the device the activations are on) and lives as long as the wrapper;
    graphs of one model on different devices each keep theirs. ``spent`` is what the graphs of
    the current step offload, so the host budget and the disk's free space bound the step, not
    each graph (the wrapper resets it at every call, as it does the step budget).
    """

    def __init__(self, options: OffloadOptions) -> None:
        """``options``: the wrapper's ``memfit.Options`` (an ``OffloadOptions``)."""
        self.options = options
        self.stores: dict[str, OffloadStore] = {}
        self.store: OffloadStore | None = None  # the store of the graph planned last
        self.spent = 0

    def prepare(self, jg: JointGraph) -> tuple[Link, str, int | None]:
        """The link, destination and byte limit the planner offloads ``jg``'s values with."""
        device = activation_device(jg)
        to = self.options.offload_destination(device)
        if to not in self.stores:
            self.stores[to] = OffloadStore(to, self.options.offload_dir)
        self.store = self.stores[to]
        limits = [self.options.host_budget_bytes]
        free = self.store.free_disk_bytes()
        if free is not None:
            limits.append(int(0.9 * free))
        limit = min((n for n in limits if n is not None), default=None)
        if limit is not None:
            limit = max(limit - self.spent, 0)
        if self.options.offload_bandwidth is not None:
            bandwidth = self.options.offload_bandwidth
            return Link(bandwidth, bandwidth, overlap=copy_overlap(device)), to, limit
        with disable_current_modes():  # the partitioner traces under fake tensors: measure real
            return measure_link(to, device, self.options.offload_dir), to, limit

    def reserve(self, plan: GraphPlan) -> None:
        """Hold host memory for ``plan``'s offload (counted against the step when it runs)."""
        if not plan.transfers or self.store is None:
            return
        with disable_current_modes():  # a real pinned arena, not a fake tensor
            self.store.reserve([t.nbytes for t in plan.transfers])
