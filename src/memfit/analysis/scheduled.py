"""The peak of a graph as Inductor runs it, from the buffer lifetimes of its compiled schedule.

Why not the simulator: with ``executor="inductor"`` the forward and backward graphs memfit planned
are compiled by Inductor, which fuses ops (a value that lives only inside a fused kernel is never
allocated), lays out convolutions channels-last, and picks its own kernel order to lower its peak.
Replaying the graphs op by op then mispredicts in both directions: measured on the budget
frontier's models (CPU), the step peaked at 0.66-0.84x the simulation on a U-Net and up to 1.30x
on a transformer encoder, whose backward Inductor ran with more alive than memfit's order. The
order Inductor's generated code runs, and when it frees each buffer, are known once the graph is
scheduled (``_compat.inductor_schedule`` records them); this module turns that timeline into the
bytes the step holds, counted as the simulator counts them: per storage, above what was alive
before the step.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

__all__ = ["Schedule", "Timeline", "scheduled_peak"]

#: One buffer of a scheduled graph: ``(name, is_graph_input, bytes_allocated, bytes_freed,
#: first_step, last_step)``; ``last_step`` -1 is a graph output (alive when the graph returns).
Timeline = Sequence[tuple[str, bool, int, int, int, int]]


@dataclass(frozen=True)
class Schedule:
    """What Inductor's scheduler decided for one compiled graph, as memory sees it."""

    #: every buffer, in the order the kernels run
    buffers: Timeline
    #: for each graph output in order, the name of the buffer (or graph input) it is a view of:
    #: outputs that share one are one allocation
    outputs: tuple[str, ...]

    def output_bytes(self, names: Sequence[str]) -> dict[str, int]:
        """The bytes of each buffer this graph allocated among ``names`` (graph inputs and
        buffers it did not allocate are left out)."""
        wanted = set(names)
        return {
            name: alloc
            for name, is_input, alloc, _, _, _ in self.buffers
            if name in wanted and not is_input
        }


#: For a graph input's name: the storages it is a view of that count, each with its bytes (none
#: where the input costs nothing: a parameter or user input, alive before the step began); a
#: KeyError for a name it does not know, which is then counted at the size Inductor gives it.
InputStorage = Callable[[str], Sequence[tuple[Hashable, int]]]


def scheduled_peak(timeline: Timeline, input_storage: InputStorage, held_bytes: int = 0) -> int:
    """The most bytes alive at once while the scheduled graph runs, plus ``held_bytes``.

    Buffers the graph allocates count from the kernel that writes them until after their last
    reader, as Inductor's code frees them. Graph inputs count once per storage (two saved views of
    one tensor are one allocation; Inductor's own estimate counts each) from the start until their
    last reader, and not at all where ``input_storage`` names no storage for them.
    ``held_bytes`` is what something outside the graph keeps alive throughout (the forward's
    outputs, which the user's code holds while the backward runs).
    """
    steps = 1 + max((max(start, end) for _, _, _, _, start, end in timeline), default=0)
    delta = [0] * (steps + 1)
    inputs: dict[Hashable, tuple[int, int]] = {}  # storage -> (bytes, last step; -1: to the end)
    for name, is_input, alloc, freed, start, end in timeline:
        if is_input:
            try:
                storages = input_storage(name)
            except KeyError:
                storages = [(("input", name), alloc)]
            for key, nbytes in storages:
                _, last = inputs.get(key, (nbytes, end))
                inputs[key] = (nbytes, -1 if -1 in (last, end) else max(last, end))
            continue
        delta[start] += alloc
        if end != -1:
            delta[end + 1] -= freed
    for nbytes, last in inputs.values():
        delta[0] += nbytes
        if last != -1:
            delta[last + 1] -= nbytes
    peak = current = 0
    for change in delta:
        current += change
        peak = max(peak, current)
    return peak + held_bytes
