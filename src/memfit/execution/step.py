"""``memfit.step``: a whole training step (model and loss) captured and planned as one unit.

``memfit.checkpoint`` applies to a model, so a loss computed outside it (``criterion(model(x), y)``)
is outside every graph memfit plans: its saved tensors (a language model's log-softmax over the
vocabulary) and its gradients are not in the prediction and not under the budget. A step
function that computes the loss from a batch puts them inside: Dynamo captures model and loss
together, the backend plans the joint graph from the inputs to the loss, and the plan's
prediction covers everything the step allocates up to its gradients.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Sequence
from typing import Any, overload

from memfit.execution.executors import EAGER, check_executor
from memfit.execution.module import resolve_policy
from memfit.execution.offload import OffloadOptions, OffloadStore
from memfit.execution.planned import DEFAULT_MAX_SHAPES, PlannedCall
from memfit.planning.budget import Budget
from memfit.planning.plan import Plan
from memfit.planning.policy import Policy

__all__ = ["step", "Step"]


class Step:
    """A step function run under a memfit plan; call it as the function, read ``plan`` after."""

    def __init__(
        self,
        fn: Callable[..., Any],
        policy: Policy,
        attention: str,
        offload: OffloadOptions | None,
        max_shapes: int,
        executor: str = EAGER,
    ) -> None:
        functools.update_wrapper(self, fn)
        self._planned = PlannedCall(
            fn,
            policy,
            name=getattr(fn, "__qualname__", type(fn).__name__),
            attention=attention,
            offload=offload,
            max_shapes=max_shapes,
            executor=executor,
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._planned(*args, **kwargs)

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        # Decorating a method: bind like a function does, one Step (and plan) for the class.
        return self if instance is None else types.MethodType(self, instance)

    @property
    def plan(self) -> Plan:
        """The plan of the graphs the last training call ran (each input shape has its own)."""
        return self._planned.plan

    @property
    def policy(self) -> Policy:
        return self._planned.policy

    @property
    def replan_pending(self) -> bool:
        """Whether the next call plans again (see ``memfit.checkpoint``'s ``measure_outside``)."""
        return self._planned.replan_pending

    @property
    def offload_store(self) -> OffloadStore | None:
        """Where this step's offloaded activations live (None until a plan offloads)."""
        return self._planned.offload_store

    def __repr__(self) -> str:
        return f"memfit.step({self._planned.name}, policy={self.policy.label!r})"

    def __reduce__(self) -> Any:
        raise TypeError(
            f"a memfit.step ({self._planned.name}) holds compiled graphs and cannot be pickled; "
            "save the model's state_dict and apply memfit.step to the function again after "
            "loading"
        )


@overload
def step(
    fn: Callable[..., Any],
    *,
    policy: Policy | str | None = None,
    budget: int | str | float | Budget | None = None,
    attention: str = "auto",
    checkpoints: str | None = None,
    offload: bool | OffloadOptions = False,
    offload_to: str | None = None,
    offload_dir: str | None = None,
    max_shapes: int = DEFAULT_MAX_SHAPES,
    executor: str = EAGER,
    autotune: bool = False,
) -> Step: ...


@overload
def step(
    fn: None = None,
    *,
    policy: Policy | str | None = None,
    budget: int | str | float | Budget | None = None,
    attention: str = "auto",
    checkpoints: str | None = None,
    offload: bool | OffloadOptions = False,
    offload_to: str | None = None,
    offload_dir: str | None = None,
    max_shapes: int = DEFAULT_MAX_SHAPES,
    executor: str = EAGER,
    autotune: bool = False,
) -> Callable[[Callable[..., Any]], Step]: ...


def step(
    fn: Callable[..., Any] | None = None,
    *,
    policy: Policy | str | None = None,
    budget: int | str | float | Budget | None = None,
    attention: str = "auto",
    checkpoints: str | None = None,
    offload: bool | OffloadOptions = False,
    offload_to: str | None = None,
    offload_dir: str | None = None,
    max_shapes: int = DEFAULT_MAX_SHAPES,
    executor: str = EAGER,
    autotune: bool = False,
) -> Step | Callable[[Callable[..., Any]], Step]:
    """Run the training step ``fn`` (batch in, loss out) with fewer activations kept.

    ``fn`` computes the loss: the model's forward and the criterion both inside it. The returned
    ``Step`` is called like ``fn`` and returns its loss; call ``.backward()`` on it as usual (and
    the optimizer after). Its ``plan`` covers the whole step, loss included, so the predicted
    peak and a byte budget bound what the step really allocates. Use it as a decorator, bare or
    with arguments::

        @memfit.step(budget="2GiB")
        def train_step(x, y):
            return criterion(model(x), y)

        loss = train_step(x, y); loss.backward(); optimizer.step(); optimizer.zero_grad()

    ``policy``, ``budget``, ``attention``, ``offload`` and its options, ``max_shapes``,
    ``executor`` and ``autotune`` are ``memfit.checkpoint``'s, except policies naming
    submodules: a step has no single model to name them in (use
    ``memfit.checkpoint(model, [...])`` or ``memfit.mark``).
    """
    if isinstance(fn, (str, Policy)) and policy is None and budget is None:
        fn, policy = None, fn  # @memfit.step("memory")
    if isinstance(policy, Sequence) and not isinstance(policy, str):
        raise ValueError(
            "a step has no single model to name submodules in: use a policy name or a budget, "
            "memfit.mark in the model, or memfit.checkpoint(model, [names]) for the model"
        )
    chosen, options = resolve_policy(
        policy, budget, checkpoints, attention, offload, offload_to, offload_dir, "step", autotune
    )
    check_executor(executor)
    if chosen.modules:
        raise ValueError(
            f"policy {chosen.label!r} names submodules; a step has no single model to name them "
            "in: use memfit.checkpoint(model, [names]) for the model, or memfit.mark"
        )

    def wrap(function: Callable[..., Any]) -> Step:
        if not callable(function):
            raise TypeError(f"memfit.step expects a function, got {type(function).__name__}")
        if isinstance(function, Step):
            raise TypeError("this function is already a memfit.step; apply it once")
        return Step(function, chosen, attention, options, max_shapes, executor)

    return wrap if fn is None else wrap(fn)
