"""What a memfit backend is built with: ``BackendSettings``, the one object that holds the policy.

A memfit call (``execution.session``) resolves what the user asked (``execution.options``) once
into these settings and hands them to ``make_backend`` (``execution.backend``), which hands them
to the partitioner (``execution.partitioner``); every part that needs the policy, the executor or
the offloader reads it from here or receives it as an argument, so the policy is stored in one
object from the entry point to the planner. What the backend reports back goes
through one interface, ``execution.events.BackendEvents``.
"""

from __future__ import annotations

import dataclasses

from memfit.execution.executors import EAGER
from memfit.execution.offload import Offloader
from memfit.planning.policy import Policy

__all__ = ["BackendSettings", "NONE", "StepBudget"]

#: How graphs inside a region are planned: its recomputation is the one recomputation.
NONE = Policy("none")


@dataclasses.dataclass
class StepBudget:
    """What the graphs of one training step have kept so far, for a byte budget shared by them.

    With graph breaks, the graphs of one step are planned one after the other as the step first
    runs; values kept by earlier graphs stay alive while later ones run, so each graph gets the
    budget less what the graphs that ran before it in this step keep (counted as each graph's
    forward runs, so a graph compiled in an earlier step counts too). The call resets ``spent``
    at every call.
    """

    spent: int = 0


# Compared by identity (eq=False): it holds the offloader and the step budget, which change.
@dataclasses.dataclass(frozen=True, eq=False)
class BackendSettings:
    """How every joint graph a backend is handed is rewritten, planned and run."""

    #: what to keep for the backward: the objective every graph is planned for
    policy: Policy
    #: how the split graphs run: ``"eager"`` (ATen kernels, FX code) or ``"inductor"``
    executor: str = EAGER
    #: ``"auto"``: every attention rewritten to a kernel keeping no Lq x Lk tensor
    #: (``capture.attention``); ``"off"``: left as it is
    attention: str = "auto"
    #: ``"auto"``: every ``cross_entropy(linear(h))`` whose logits span more than one chunk
    #: rewritten to a kernel that never builds them (``capture.loss_head``); ``"off"``: left
    loss_head: str = "auto"
    #: a policy that offloads: the stores and the link each graph is planned with (None: none;
    #: ``make_backend`` makes one with default options for a policy that offloads)
    offloader: Offloader | None = None
    #: a byte budget shared by the step's graphs: what the graphs run so far in this step keep
    #: (None: no budget, or graphs planned on their own, as a region's are)
    step_budget: StepBudget | None = None

    def in_regions(self) -> BackendSettings:
        """The settings of the graphs inside regions (``execution.regions``): planned with
        ``"none"``, since a region's recomputation is the one recomputation, and outside the
        step's budget and offload (what they keep lives only while their region is
        recomputed)."""
        return dataclasses.replace(self, policy=NONE, offloader=None, step_budget=None)
