"""The configurations ``schedule="auto"`` compared: ``Candidate``, one row each, and its table.

Kept apart from ``auto``, which makes them, because a ``PipelinePlan`` (``stages``) carries
and prints them: both read this module, neither the other's.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.pipeline.schedule import PipelineSchedule
from memfit.units import format_bytes

__all__ = ["Candidate", "candidate_table"]


@dataclass(frozen=True)
class Candidate:
    """One configuration ``auto`` compared, and what memfit predicts for it."""

    schedule: PipelineSchedule
    stages_per_rank: int
    microbatches: int
    #: the predicted step and bubble, or None when no split fits the budget
    step_seconds: float | None
    bubble: float | None
    #: the largest rank's predicted peak; when refused, the least memfit reached
    peak_bytes: int | None
    #: recomputation and offload stall as a share of the stages' compute
    added_share: float = 0.0
    #: bytes offloaded per step, over all stages
    offloaded_bytes: int = 0
    #: why it was refused ("" when it fits)
    refused: str = ""
    chosen: bool = False

    @property
    def fits(self) -> bool:
        return self.step_seconds is not None

    def key(self) -> tuple[float, int, int, int]:
        """Order of preference among those that fit: least step, least peak, fewest stages
        per rank, torch's order of schedules."""
        order = list(PipelineSchedule).index(self.schedule)
        return (self.step_seconds or 0.0, self.peak_bytes or 0, self.stages_per_rank, order)


def candidate_table(candidates: tuple[Candidate, ...] | list[Candidate]) -> str:
    """The configurations compared, one line each, the chosen one marked ``*``."""
    lines = [
        f"  {'schedule':<24} {'V':>2} {'M':>3} {'step':>10} {'bubble':>7} {'peak':>10} "
        f"{'added':>6} {'offloaded':>10}"
    ]
    for c in candidates:
        mark = "*" if c.chosen else " "
        head = f"{mark} {c.schedule.value:<24} {c.stages_per_rank:>2} {c.microbatches:>3}"
        if not c.fits:
            least = f"least {format_bytes(c.peak_bytes)}" if c.peak_bytes is not None else ""
            lines.append(f"{head} {'refused':>10} {c.refused}{': ' if least else ''}{least}")
            continue
        lines.append(
            f"{head} {(c.step_seconds or 0) * 1e3:>8.2f}ms {c.bubble or 0:>7.1%} "
            f"{format_bytes(c.peak_bytes or 0):>10} {c.added_share:>6.1%} "
            f"{format_bytes(c.offloaded_bytes):>10}"
        )
    return "\n".join(lines)
