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

from memfit.execution.options import Executor, Options, PolicyLike, resolve
from memfit.execution.planned_call import PlannedCall, PlannedView
from memfit.planning.policy import Policy

__all__ = ["step", "Step"]


class Step(PlannedView):
    """A step function run under a memfit plan; call it as the function, read ``plan`` after."""

    def __init__(
        self,
        fn: Callable[..., Any],
        policy: Policy,
        options: Options,
        executor: Executor,
    ) -> None:
        functools.update_wrapper(self, fn)
        self._planned = PlannedCall(
            fn, policy, options, executor, name=getattr(fn, "__qualname__", type(fn).__name__)
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._planned(*args, **kwargs)

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        # Decorating a method: bind like a function does, one Step (and plan) for the class.
        return self if instance is None else types.MethodType(self, instance)

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
    policy: PolicyLike = "memory",
    offload: bool = False,
    executor: Executor | str = Executor.EAGER,
    options: Options | None = None,
) -> Step: ...


@overload
def step(
    fn: PolicyLike | None = None,
    *,
    policy: PolicyLike = "memory",
    offload: bool = False,
    executor: Executor | str = Executor.EAGER,
    options: Options | None = None,
) -> Callable[[Callable[..., Any]], Step]: ...


def step(
    fn: Callable[..., Any] | PolicyLike | None = None,
    *,
    policy: PolicyLike = "memory",
    offload: bool = False,
    executor: Executor | str = Executor.EAGER,
    options: Options | None = None,
) -> Step | Callable[[Callable[..., Any]], Step]:
    """Run the training step ``fn`` (batch in, loss out) with fewer activations kept.

    ``fn`` computes the loss: the model's forward and the criterion both inside it. The returned
    ``Step`` is called like ``fn`` and returns its loss; call ``.backward()`` on it as usual (and
    the optimizer after). Its ``plan`` covers the whole step, loss included, so the predicted
    peak and a byte budget bound what the step really allocates. Use it as a decorator, bare or
    with arguments (``@memfit.step(policy="2GiB")``, or the policy alone: ``@memfit.step(0.5)``)::

        @memfit.step(policy="2GiB")
        def train_step(x, y):
            return criterion(model(x), y)

        loss = train_step(x, y); loss.backward(); optimizer.step(); optimizer.zero_grad()

    ``policy``, ``offload``, ``executor`` and ``options`` are ``memfit.checkpoint``'s, except
    policies naming submodules: a step has no single model to name them in (use
    ``memfit.checkpoint(model, [...])`` or ``memfit.mark``).
    """
    if fn is not None and not callable(fn):
        if policy != "memory":
            raise TypeError(
                f"memfit.step got {fn!r} where the step function goes, and policy={policy!r}: "
                f"give the policy once"
            )
        policy, fn = fn, None  # @memfit.step(0.5)
    if isinstance(policy, Sequence) and not isinstance(policy, str):
        raise ValueError(
            "a step has no single model to name submodules in: use a policy name or a budget, "
            "memfit.mark in the model, or memfit.checkpoint(model, [names]) for the model"
        )
    chosen, resolved, ran = resolve(policy, offload, executor, options)
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
        return Step(function, chosen, resolved, ran)

    return wrap if fn is None else wrap(fn)
