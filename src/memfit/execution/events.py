"""What a memfit backend reports to the call it serves: ``BackendEvents``, one interface.

The backend (``execution.backend``), its partitioner (``execution.partitioner``) and the compiled
graphs it returns (``execution.runners``) run inside Dynamo and AOTAutograd, long after the call
that made them returned, and Dynamo reuses a graph compiled earlier without asking the backend
again. So what the call needs to know (which plans were made, which ran, when a backward
started, what could not be measured) is reported as it happens, and what a graph is planned
against that the call learned on earlier steps (what the caller held outside the graph, the start
of its backward, its share of a step planned as a whole, how a chain plans it) is asked as the
graph is planned. Both go through this one interface, implemented by the call's session
(``execution.session.CallSession``).
"""

from __future__ import annotations

from typing import Protocol

from memfit.analysis.graph import BackwardStart
from memfit.planning.plan import GraphPlan
from memfit.planning.step_budget import GraphShare

__all__ = ["BackendEvents"]


class BackendEvents(Protocol):
    """What a backend tells its call (reports) and asks it (questions), per graph ``key``
    (``GraphPlan.key``: a Dynamo graph and its inputs' shapes)."""

    def compiling(self) -> None:
        """Dynamo hands the backend a graph, before anything else is done with it (the call
        looks at which modules are running eagerly then: ``execution.regions``)."""

    def plan_made(self, graph: GraphPlan) -> None:
        """A graph's plan was made (at capture)."""

    def graph_ran(self, graph: GraphPlan) -> None:
        """A planned graph's forward runs, with its plan at the sizes of this run: Dynamo reuses
        graphs compiled earlier without calling the backend, so this says which plans a call
        ran. For a graph captured with symbolic sizes, the plan at the sizes the call ran
        (NOTE [One capture for many sizes] in ``planning.resize``)."""

    def budget_missed(self, graph: GraphPlan) -> None:
        """A graph planned for a range of sizes exceeds its budget at the sizes that just ran
        (between the sizes the range was checked at): the call plans again."""

    def backward_started(self, graph: GraphPlan) -> None:
        """A planned graph's backward starts: the code between forward and backward is done."""

    def backward_start_seen(self, key: str, seen: BackwardStart, material: bool) -> None:
        """At a graph's first backward, the start seen there (which outputs the caller held,
        which got no gradient: ``execution.start_watch``) where it differs from the one planned
        for; ``material``: by enough to plan again."""

    def unmeasured(self) -> None:
        """A graph compiled by Inductor could not be measured, because a CPU profiler session
        was running (a ``memfit.measure`` around the first call): its peaks are Inductor's
        schedule's estimate, and the call plans again, measured, outside such a session."""

    def outside_bytes(self, key: str, output_bytes: int) -> int:
        """What the step holds outside graph ``key`` between its forward and backward, when the
        graph's outputs take ``output_bytes``: the plan reserves it."""
        ...

    def backward_start(self, key: str) -> BackwardStart | None:
        """The start of graph ``key``'s backward seen on an earlier step (None: assumed,
        ``analysis.backward_start``)."""
        ...

    def share(self, sized_key: str) -> GraphShare | None:
        """Once a step with graph breaks has been planned as a whole (``planning.step_budget``):
        the graph's share of the step's budget at the sizes ``sized_key`` names
        (``GraphPlan.sized_key``); None before that: each graph is planned as the step's first
        call reaches it."""
        ...

    def chain_mode(self) -> tuple[bool, int | None] | None:
        """How a graph that runs in a chain (``planning.plan_chain``) is planned: None, by the
        policy; else ``(least_kept, step_budget)``: as ``"memory"`` plans it, keeping the least
        it can if ``least_kept`` (``planning.frontier.least_kept_point``), under a budget of
        ``step_budget`` bytes that the chain's segments hold for the step."""
        ...
