"""What the backward gets for one forward value: the unit of every memfit plan.

A plan is a ``Decision`` for every forward value the backward reads, directly or to recompute
another value from. Execution builds its graphs from these decisions alone, so whatever a policy
optimises (least memory, least recompute time within a budget, the user's marks), the result is
stated in one vocabulary that the executor, the simulator and a user can all read.
"""

from __future__ import annotations

import enum

__all__ = ["Decision"]


class Decision(enum.Enum):
    """How a forward value reaches the backward pass."""

    #: Kept in memory from the forward to the backward (plain autograd does this for everything).
    KEEP = "keep"
    #: Freed after its last forward use and computed again in backward, just before it is read.
    RECOMPUTE = "recompute"
    #: Copied to host memory or disk after it is produced, freed on the device once the copy is
    #: done, and copied back before its first backward reader (``analysis.transfers``).
    OFFLOAD = "offload"
