"""What ``memfit.checkpoint``, ``memfit.step`` and ``memfit.plan`` are asked, checked once.

The three entry points take the same few arguments: a ``policy`` (what to keep: a name, a list
of submodule names, or a budget), ``offload`` (whether the planner may offload), ``executor``
(how the plan runs) and ``options``, one ``Options`` holding the advanced knobs, as
``torch.compile`` keeps its own behind ``options=`` and torchtitan documents each config field in
its dataclass. ``resolve`` turns them into plain data at that boundary: a ``Policy`` (the
objective, the budget, whether it may offload) that planning reads, and the knobs execution
reads. Nothing below it sees what the user wrote.

Closed choices are string enums, so ``"inductor"`` and ``memfit.Executor.INDUCTOR`` are the same
value, and a misspelt string fails here, naming the choices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from memfit.capture.attention import Attention
from memfit.capture.loss_head import LossHead
from memfit.execution.executors import Executor
from memfit.execution.offload.offload_options import OffloadOptions, OffloadTarget
from memfit.planning.budget import Budget
from memfit.planning.policy import Policy, parse_policy

__all__ = [
    "Attention",
    "Executor",
    "LossHead",
    "OffloadTarget",
    "Options",
    "PolicyLike",
    "resolve",
    "DEFAULT_MAX_SHAPES",
]

#: What ``policy=`` accepts: a name, submodule names, or a budget (bytes, size, fraction).
PolicyLike = str | int | float | Sequence[str] | Budget | Policy

#: Captures (one input shape, or one range of sizes captured as symbols) of one model or step
#: before a call that needs another runs unplanned (with a warning).
DEFAULT_MAX_SHAPES = 64


@dataclass(frozen=True, kw_only=True)
class Options(OffloadOptions):
    """The advanced knobs of ``memfit.checkpoint``, ``memfit.step`` and ``memfit.plan``.

    The defaults are what most users want; each field says when to change it. The offload fields
    (``offload_to``, ``offload_dir``, ``offload_bandwidth``, ``offload_min_bytes``,
    ``host_budget``) come from the base class ``OffloadOptions``, where each is defined,
    defaulted and checked, and need ``offload=True``. Every field is a keyword.
    """

    #: ``"auto"``: rewrite every attention memfit finds to a kernel that keeps no n² tensor
    #: (outputs then equal plain PyTorch's to floating-point tolerance; ``plan.attention`` lists
    #: each site and its kernel). ``"off"``: leave attention as written.
    attention: Attention | str = Attention.AUTO
    #: ``"auto"``: rewrite a language model's loss head, ``cross_entropy(linear(h))``, to a
    #: kernel that computes the logits in chunks of tokens and keeps none of them for backward
    #: (loss and gradients equal plain PyTorch's to floating-point tolerance; logits the model
    #: returns are still returned; ``plan.loss_heads`` lists each head found). ``"off"``: leave
    #: it as written.
    loss_head: LossHead | str = LossHead.AUTO
    #: With a budget under ``executor="inductor"``: time the budget's plan against ``"speed"``'s
    #: on the first step and keep the faster (one more compile, some 60 more steps on the first
    #: call), like ``torch.compile``'s ``mode="max-autotune"``.
    autotune: bool = False
    #: Captures of one model (each input shape range, dtype and rank its own) before a call that
    #: needs another runs as plain PyTorch, with a warning.
    max_shapes: int = DEFAULT_MAX_SHAPES
    #: Measure what a step holds outside memfit's graphs (a loss computed outside the model) on
    #: the first step, and plan again with it reserved, so predictions and budgets cover the
    #: whole step. Off only where the caller models that memory itself.
    measure_outside: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()  # the offload fields, checked now, before any step runs
        set_ = object.__setattr__
        set_(self, "attention", Attention.parse(self.attention, "attention", "memfit.Attention"))
        set_(self, "loss_head", LossHead.parse(self.loss_head, "loss_head", "memfit.LossHead"))
        for name in ("autotune", "measure_outside"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Options.{name} is True or False, got {getattr(self, name)!r}")
        shapes = self.max_shapes
        if isinstance(shapes, bool) or not isinstance(shapes, int) or shapes < 1:
            raise ValueError(f"Options.max_shapes must be a positive int, got {shapes!r}")


def resolve(
    policy: PolicyLike, offload: bool, executor: Executor | str, options: Options | None
) -> tuple[Policy, Options, Executor]:
    """The policy, options and executor the arguments ask for, checked, with ``offload`` and
    ``autotune`` folded into the policy: the plain data planning and execution read."""
    if options is None:
        options = Options()
    elif not isinstance(options, Options):
        raise TypeError(f"options is a memfit.Options, got {type(options).__name__}")
    if not isinstance(offload, bool):
        raise TypeError(
            f"offload is True or False, got {offload!r}; where and how values are offloaded "
            f"is set in options=memfit.Options(offload_to=..., offload_dir=..., ...)"
        )
    chosen = parse_policy(policy)
    ran = Executor.parse(executor, "executor", "memfit.Executor")
    if options.autotune and not chosen.autotune:
        # Policy checks it goes with a budget
        chosen = dataclasses.replace(chosen, autotune=True)
    if offload and not chosen.offload:
        chosen = dataclasses.replace(chosen, offload=True)
    if options.offload_given and not chosen.offload:
        raise ValueError(
            "the offload options configure offloading: pass offload=True (with a budget or "
            "'memory') or use policy 'swap'"
        )
    return chosen, options, ran
