"""``memfit.checkpoint(model, policy)``: the model, trained with fewer activations kept.

The wrapper is a view of the user's model, not a copy: it shares the model's parameter, buffer and
submodule dictionaries, so its ``state_dict`` has the same keys and tensors, an optimizer built on
either sees the same parameters, and ``.to()`` moves both. Its forward runs the model through
``torch.compile`` with memfit's backend (static shapes, so a new input shape or dtype is captured
and planned again). Submodule names in a policy list (``memfit.checkpoint(model, ["layer1"])``)
are turned into marks by forward hooks that act only while memfit captures, so the user's own
eager calls are untouched.

``memfit.plan`` answers "what would memfit do within this budget?" without training: it runs the
capture (one forward, under the plan) and puts back every buffer and random-number state the
forward touched, so BatchNorm statistics and later dropout masks are as if it never ran.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from memfit._compat import tree_map
from memfit.capture.attention import ATTENTION_MODES
from memfit.capture.graph_breaks import GraphBreakWatcher
from memfit.capture.mark import mark
from memfit.execution.backend import Offloader, StepBudget, make_backend
from memfit.execution.offload import OffloadError, OffloadOptions, OffloadStore
from memfit.execution.state import preserved
from memfit.planning.budget import Budget, BudgetError, parse_budget
from memfit.planning.plan import GraphPlan, Plan
from memfit.planning.policy import BUDGET, Policy, parse_policy

__all__ = ["checkpoint", "plan", "CheckpointedModule"]


def _planning_error(exc: BaseException) -> BudgetError | OffloadError | None:
    """The BudgetError or OffloadError behind Dynamo's wrapping of backend exceptions, if any."""
    seen = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, (BudgetError, OffloadError)):
            return current
        seen.add(id(current))
        current = (
            getattr(current, "inner_exception", None) or current.__cause__ or current.__context__
        )
    return None


_capturing = 0  # >0 while a memfit wrapper runs: module-name hooks mark only then


def _mark_tree(out: Any) -> Any:
    return tree_map(lambda t: mark(t) if isinstance(t, torch.Tensor) else t, out)


def _mark_output_hook(module: nn.Module, args: Any, out: Any) -> Any:
    if _capturing and torch.compiler.is_compiling():
        return _mark_tree(out)
    return None


class CheckpointedModule(nn.Module):
    """``model`` with memfit's checkpointing applied; see ``memfit.checkpoint``."""

    # Set through __dict__ in __init__: nn.Module's __setattr__ would register the model as a
    # submodule (its parameters would appear twice under new names).
    _model: nn.Module
    _policy: Policy
    _plan: Plan | None
    _pending: list[GraphPlan]
    _watcher: GraphBreakWatcher
    _step_budget: StepBudget | None
    _compiled: Callable[..., Any]
    _hooks: list[Any]
    _offloader: Offloader | None

    def __init__(
        self,
        model: nn.Module,
        policy: Policy,
        attention: str = "auto",
        offload: OffloadOptions | None = None,
    ) -> None:
        super().__init__()
        # Share, do not copy: same Parameter objects under the same state_dict keys.
        self._parameters = model._parameters
        self._buffers = model._buffers
        self._modules = model._modules
        self.__dict__["_model"] = model
        self.__dict__["_policy"] = policy
        self.__dict__["_plan"] = None
        self.__dict__["_pending"] = []
        self.__dict__["_watcher"] = GraphBreakWatcher(type(model).__name__)
        self.__dict__["_step_budget"] = StepBudget() if policy.name == BUDGET else None
        self.__dict__["_offloader"] = (
            Offloader(offload or OffloadOptions()) if policy.offload else None
        )
        self.__dict__["_compiled"] = torch.compile(
            model,
            backend=make_backend(
                policy, self._pending.append, self._step_budget, attention, self._offloader
            ),
            dynamic=False,
        )
        named = dict(model.named_modules())
        self.__dict__["_hooks"] = [
            named[name].register_forward_hook(_mark_output_hook) for name in policy.modules
        ]
        self.training = model.training

    @property
    def module(self) -> nn.Module:
        """The wrapped model (shared, not copied)."""
        return self._model

    @property
    def policy(self) -> Policy:
        """The policy this wrapper plans with."""
        return self._policy

    @property
    def offload_store(self) -> OffloadStore | None:
        """Where this wrapper's offloaded activations live (None until a plan offloads)."""
        return self._offloader.store if self._offloader else None

    @property
    def plan(self) -> Plan:
        """What the last capture keeps and recomputes; available after the first training call."""
        if self._plan is None:
            raise RuntimeError(
                "memfit has not planned this model yet: the plan is made when the model is first "
                "called with inputs that require a backward (a training step); call it once first"
            )
        return self._plan

    def train(self, mode: bool = True) -> CheckpointedModule:
        self._model.train(mode)
        self.training = mode
        return self

    @torch.compiler.disable(recursive=False)
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        global _capturing
        _capturing += 1
        if self._step_budget is not None:
            self._step_budget.spent = 0
        if self._offloader is not None:
            self._offloader.spent = 0
        try:
            with self._watcher.watch() as report:
                out = self._compiled(*args, **kwargs)
        except Exception as exc:
            self._pending.clear()
            planning_error = _planning_error(exc)
            if planning_error is not None:
                raise planning_error.with_traceback(None) from None
            raise
        finally:
            _capturing -= 1
        if self._pending:
            graphs: list[GraphPlan] = list(self._pending)
            self._pending.clear()
            self.__dict__["_plan"] = Plan(policy=self._policy.name, graphs=tuple(graphs))
        if report.broke:
            report.warn_once()
        return out

    def extra_repr(self) -> str:
        return f"policy={self._policy.label!r}, model={type(self._model).__name__}"


def _validate_names(model: nn.Module, names: Sequence[str]) -> None:
    known = [name for name, _ in model.named_modules() if name]
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=5, cutoff=0.0)
            hint = f"; closest existing names: {', '.join(map(repr, close))}" if close else ""
            raise ValueError(
                f"{name!r} is not a submodule of {type(model).__name__} "
                f"(names as in model.named_modules()){hint}"
            )


def checkpoint(
    model: nn.Module,
    policy: Policy | str | Sequence[str] | None = None,
    *,
    budget: int | str | float | Budget | None = None,
    attention: str = "auto",
    checkpoints: str | Sequence[str] | None = None,
    offload: bool | OffloadOptions = False,
    offload_to: str | None = None,
    offload_dir: str | None = None,
) -> CheckpointedModule:
    """Wrap ``model`` so its training steps keep fewer activations and recompute the rest.

    ``policy`` is ``"memory"`` (the default; automatic: the least activation memory with at most
    one recomputation of each forward op), ``"speed"`` (keep outputs of matmul/conv/attention,
    recompute cheap ops), ``"collection"`` (keep the tensors marked with ``memfit.mark``),
    ``"none"`` (keep everything: the baseline), or a list of submodule names whose outputs are
    kept. Or give ``budget`` instead (or the policy ``"budget=B"``): bytes (``int``), a size
    (``"2GiB"``, ``"750MB"``) or a fraction in (0, 1] of plain autograd's activation memory; memfit
    then keeps what makes the recomputation cheapest while the predicted peak stays within it, and
    raises ``memfit.BudgetError`` (with the least reachable peak) on the first call if nothing
    fits. The returned module shares the model's parameters and buffers; its ``plan`` describes
    the choice after the first training call. ``checkpoints=`` is the old name of ``policy``.

    ``attention="auto"`` (the default) rewrites every attention memfit finds in the model to a
    kernel that keeps no sequence-length-squared tensor: PyTorch's fused SDPA where it applies,
    memfit's chunked kernel otherwise (dropout masks as ``F.dropout`` draws them). Outputs then
    equal plain PyTorch's to floating-point tolerance rather than bit for bit; ``plan.attention``
    lists every site and the kernel chosen. ``attention="off"`` leaves attention as written.

    Offload (Meng et al. 2017): ``policy="swap"`` recomputes nothing and offloads every saved
    value whose copies can hide behind compute; ``offload=True`` with a budget (or ``"memory"``)
    lets the planner choose per value between keeping, recomputing and offloading, the cheapest
    mix (recompute time plus predicted stall) that fits. ``offload_to`` is ``"host"`` (CUDA
    activations to pinned host memory) or ``"disk"`` (files in a private directory under
    ``offload_dir`` or the system temp dir, removed as they are read back); by default host on
    CUDA, disk on CPU. ``offload=memfit.OffloadOptions(...)`` sets these and more (a link
    bandwidth instead of the measured one, the smallest value worth offloading). The plan
    reports ``offloaded``, ``offloaded_bytes``, ``host_peak_bytes``, ``transfer_seconds`` and
    ``stall_seconds``.
    """
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"memfit.checkpoint expects an nn.Module, got {type(model).__name__}")
    if isinstance(model, CheckpointedModule):
        raise TypeError("this model is already wrapped by memfit.checkpoint; wrap the original")
    if checkpoints is not None:
        if policy is not None:
            raise ValueError("give the policy once: checkpoints= is the old name of policy=")
        warnings.warn(
            "memfit.checkpoint(checkpoints=...) is now memfit.checkpoint(policy=...)",
            DeprecationWarning,
            stacklevel=2,
        )
        policy = checkpoints
    options = _offload_options(offload, offload_to, offload_dir)
    offload = options is not None and offload is not False
    if budget is not None:
        if policy is not None:
            raise ValueError(
                "give either a policy or budget=, not both: with a budget memfit chooses "
                "what to keep itself"
            )
        return CheckpointedModule(
            model, Policy(BUDGET, budget=parse_budget(budget), offload=offload), attention, options
        )
    chosen = parse_policy("memory" if policy is None else policy)
    if offload and not chosen.offload:
        chosen = Policy(chosen.name, chosen.budget, chosen.modules, offload=True)
    if options is not None and not chosen.offload:
        raise ValueError(
            "offload_to/offload_dir configure offloading: pass offload=True (with a budget or "
            "'memory') or use policy 'swap'"
        )
    _validate_names(model, chosen.modules)
    if isinstance(policy, (list, tuple)) and not chosen.modules:
        warnings.warn(
            "an empty list of submodules marks nothing: every activation will be recomputed",
            stacklevel=2,
        )
    return CheckpointedModule(model, chosen, attention, options)


def _offload_options(
    offload: bool | OffloadOptions, to: str | None, directory: str | None
) -> OffloadOptions | None:
    """One ``OffloadOptions`` from ``offload=`` and the two shorthand arguments, or None."""
    if isinstance(offload, OffloadOptions):
        if to is not None or directory is not None:
            raise ValueError("give offload_to/offload_dir inside OffloadOptions, not beside it")
        return offload
    if not isinstance(offload, bool):
        raise TypeError(f"offload is True, False or memfit.OffloadOptions, got {offload!r}")
    if not offload and to is None and directory is None:
        return None
    return OffloadOptions(to=to, directory=directory)


def plan(
    model: nn.Module,
    *example_inputs: Any,
    budget: int | str | float | Budget = 1.0,
    attention: str = "auto",
    offload: bool | OffloadOptions = False,
    offload_to: str | None = None,
    offload_dir: str | None = None,
    **example_kwargs: Any,
) -> Plan:
    """What ``checkpoint(model, budget=budget)`` would keep and recompute, without training.

    Runs one forward of ``model`` on the example inputs under the plan (so the call itself stays
    within the budget) and then restores every buffer (BatchNorm running statistics) and the CPU
    and CUDA random-number states, so the model and later random draws are exactly as before; no
    backward runs and no gradient is touched. The returned plan has ``predicted_peak_bytes``,
    ``recompute_flops``, ``kept``/``recomputed`` and ``pareto()``. Raises ``BudgetError`` when no
    plan fits. ``offload`` and its options are ``checkpoint``'s.
    """
    wrapped = checkpoint(
        model,
        budget=budget,
        attention=attention,
        offload=offload,
        offload_to=offload_to,
        offload_dir=offload_dir,
    )
    with preserved(model.buffers()), torch.enable_grad():
        wrapped(*example_inputs, **example_kwargs)
    return wrapped.plan
