"""Report, once per wrapped model, where Dynamo could not capture the model as one graph.

A graph break is not an error for memfit: each piece is planned and checkpointed on its own, and
values crossing a break are kept, or, under ``"memory"`` and budgets, the pieces' runs form a
chain replayed in segments (``execution.run_chain``) or a submodule with a break inside is
recomputed whole (``execution.regions``). But a user should know where the break is and what
it costs, so the first call that breaks warns with Dynamo's reason and the user's source
line. Dynamo records reasons in its global counters (read through
``memfit._compat.graph_break_reasons``); the watcher compares them before and after a call.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from memfit._compat import frames_converted, graph_break_reasons
from memfit.warn import warn_user

__all__ = ["GraphBreakWatcher", "GraphBreakReport", "loop_skip_message", "skips_frame"]

_LOCATION = re.compile(r'File "([^"]+)", line (\d+)(?:, in (\w+))?')
_EXPLANATION = re.compile(r"^\s*Explanation:\s*(.+)$", re.MULTILINE)
#: Dynamo's words for data-dependent control flow (2.13: "Data-dependent branching"; earlier
#: releases: "generic_jump"), the one cause ``torch.where``/``torch.cond`` removes.
_DATA_DEPENDENT = re.compile(r"data-dependent branching|generic_jump|dynamic control flow", re.I)
#: Dynamo's words (2.13) when a break inside a ``for``/``while`` loop makes it skip the whole frame
#: and run it eagerly: then no graph of that frame exists for memfit to plan.
_LOOP_SKIP = re.compile(r"graph break in loop|graph breaks in loops are not supported", re.I)


def summarize_reason(reason: str) -> str:
    """Dynamo's reason in one line: its kind (the reason's first line), what it explained, and
    the user's source location when it names one.

    Dynamo 2.13 writes a reason as its kind, then ``Explanation:``, ``Hint:`` and debug lines,
    e.g. ``Failed to trace builtin operator`` / ``Dynamo does not know how to trace builtin
    operator `print` ...``. For data-dependent branching the kind says it all.
    """
    first = reason.strip().splitlines()[0] if reason.strip() else "unknown reason"
    explained = _EXPLANATION.search(reason)
    if explained and not is_data_dependent(first):
        first = f"{first}: {explained.group(1).strip()}"
    found = _LOCATION.findall(reason)
    if found:
        path, line, func = found[-1]
        where = f"{path}:{line}" + (f" in {func}" if func else "")
        return f"{first} at {where}"
    return first


def skips_frame(reason: str) -> bool:
    """Whether Dynamo gave up on a whole frame for this break: a break inside a ``for`` or
    ``while`` loop (torch 2.13: "graph break in loop", the frame skipped and run eagerly), so
    nothing of that frame is captured, planned or saved."""
    return bool(_LOOP_SKIP.search(reason))


def loop_skip_message(model_name: str, reasons: list[str]) -> str:
    """What a user reads when Dynamo skipped a frame of ``model_name`` for a break in a loop."""
    where = "; ".join(dict.fromkeys(summarize_reason(r) for r in reasons))
    remove = "Remove the break"
    if any(is_data_dependent(r) for r in reasons):
        remove += " (torch.where or torch.cond instead of a Python `if` on a tensor)"
    return (
        f"{model_name} ran as plain PyTorch, without a plan or savings: a graph break inside a "
        f"for/while loop ({where}) makes torch.compile skip the whole frame and run it eagerly, "
        f"so memfit captured nothing of it. {remove} to let memfit plan it."
    )


def is_data_dependent(reason: str) -> bool:
    """Whether Dynamo broke the graph at control flow on a tensor's value (an ``if`` or ``while``
    on a tensor): the break ``torch.where`` or ``torch.cond`` removes."""
    head = reason.strip().splitlines()[0] if reason.strip() else ""
    explained = _EXPLANATION.search(reason)
    return bool(_DATA_DEPENDENT.search(head + " " + (explained.group(1) if explained else "")))


@dataclass
class GraphBreakReport:
    model_name: str
    watcher: GraphBreakWatcher
    reasons: list[str] = field(default_factory=list)

    @property
    def broke(self) -> bool:
        return bool(self.reasons)

    @property
    def frame_skipped(self) -> bool:
        """Whether Dynamo skipped a whole frame for one of these breaks (``skips_frame``)."""
        return any(skips_frame(r) for r in self.reasons)

    def warn_once(self, action: str | None = None) -> None:
        """Warn, the first time only; ``action`` says what memfit does about the breaks (by
        default: each piece checkpointed on its own, values crossing a break kept)."""
        if self.watcher.warned:
            return
        self.watcher.warned = True
        where = "; ".join(dict.fromkeys(summarize_reason(r) for r in self.reasons))
        action = action or (
            "Each piece is checkpointed on its own and values that cross a break are kept"
        )
        remove = "Remove the break"
        if any(is_data_dependent(r) for r in self.reasons):
            remove += " (e.g. torch.where or torch.cond instead of a Python `if` on a tensor)"
        warn_user(
            f"memfit could not capture {self.model_name} as one graph (graph break: {where}). "
            f"It still trains correctly. {action}. {remove} to save more."
        )


class GraphBreakWatcher:
    """Watches calls of one wrapped model for new graph-break reasons.

    Every training step goes through ``watch``, so it reads Dynamo's reasons only when Dynamo
    converted a frame during the call (``_compat.frames_converted``): reading them all costs 2 us
    each time, twice a call, on steps that can take a millisecond. The reasons at the end of the
    last call that converted one stand for the reasons before the next.
    """

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.warned = False
        self._frames: object = None  # frames_converted() when _reasons was read
        self._total = -1
        self._reasons: dict[str, int] = {}

    def watch(self) -> _Watch:
        """A context for one call; its value is the call's ``GraphBreakReport``."""
        return _Watch(self)

    def _current(self) -> dict[str, int]:
        """Dynamo's reasons now, read again only if a frame was converted since last read."""
        frames, total = frames_converted()
        if frames is not self._frames or total != self._total:
            self._frames, self._total = frames, total
            self._reasons = graph_break_reasons()
        return self._reasons


class _Watch:
    """``GraphBreakWatcher.watch``: the reasons Dynamo added between enter and exit."""

    __slots__ = ("watcher", "before", "report")

    def __init__(self, watcher: GraphBreakWatcher) -> None:
        self.watcher = watcher
        self.before: dict[str, int] = {}
        self.report = GraphBreakReport(watcher.model_name, watcher)

    def __enter__(self) -> GraphBreakReport:
        self.before = self.watcher._current()
        return self.report

    def __exit__(self, *exc: object) -> None:
        before, after = self.before, self.watcher._current()
        if after is not before:
            self.report.reasons = [r for r, c in after.items() if c > before.get(r, 0)]
