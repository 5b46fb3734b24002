"""``memfit.checkpoint(model, policy)``: memfit applied to the user's model, in place.

The model stays the user's model. Like FSDP2's ``fully_shard``, memfit changes the object it is
given rather than wrapping it: its class becomes a subclass of its own class and of
``memfit.CheckpointedModule`` (same name, module and methods), and its ``forward`` becomes an
instance attribute that runs a training call through memfit's plan. So every framework sees the
model itself: ``isinstance`` against its own classes holds (``PreTrainedModel``, ``PeftModel``,
...), every attribute and method is its own (``generate``, ``save_pretrained``, ``config``),
``inspect.signature(model.forward)`` is the original's (HF ``Trainer`` keeps the dataset columns
it names), and ``state_dict()`` is the model's own, keys and buffer persistence included. Why
``forward`` and not ``__call__``: frameworks call ``forward`` directly (peft's ``LoraModel`` calls
``self.model.forward``), and the model's own hooks then run once, outside memfit's graphs, as
they would without it. memfit's per-model state is one attribute, ``model.memfit`` (the plan,
the policy), and ``memfit.remove(model)`` puts the class and ``forward`` back.

A call that does not train (``torch.no_grad()``, ``inference_mode``, ``generate``) runs the
original forward as plain PyTorch; a training call is captured by ``torch.compile`` with memfit's
backend (static shapes at first; a size that changes is captured once more as a symbol, and that
graph serves a range of sizes: see ``execution.planned_call``). Submodule names in a policy list
(``memfit.checkpoint(model, ["layer1"])``) are turned into marks by forward hooks that act only
while memfit captures, so the user's own eager calls are untouched.

``memfit.plan`` answers "what would ``memfit.checkpoint`` do?" without training: it applies
memfit for one capture (one forward, under the plan), removes it again, and puts back every
buffer and random-number state the forward touched, so BatchNorm statistics and later dropout
masks are as if it never ran.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.nn as nn

from memfit._compat import tree_map
from memfit.analysis.devices import Device
from memfit.capture.mark import mark
from memfit.execution.eager_paths import compile_only_switches, eager_paths
from memfit.execution.fake_target import fake_target, on_fake_target
from memfit.execution.options import (
    Executor,
    Options,
    PolicyLike,
    resolve,
)
from memfit.execution.planned_call import STEP_ROUNDS, PlannedCall, PlannedView, memfit_call_running
from memfit.execution.state import owned_generators, preserved
from memfit.planning.plan import Plan
from memfit.planning.policy import Policy

__all__ = ["checkpoint", "remove", "plan", "CheckpointedModule", "Checkpointing"]

M = TypeVar("M", bound=nn.Module)

#: Where a model memfit was applied to keeps its ``Checkpointing`` (in ``__dict__``, beside
#: nn.Module's own dictionaries: not a parameter, buffer or submodule, so no state_dict key).
_STATE = "_memfit"

_capturing = 0  # >0 while a memfit call runs: module-name hooks mark only then


def _mark_tree(out: Any) -> Any:
    return tree_map(lambda t: mark(t) if isinstance(t, torch.Tensor) else t, out)


def _settles_on_first_call(model: nn.Module) -> bool:
    """Whether ``model`` changes its own Python attributes on its first call.

    HuggingFace models do (a head sets ``config.problem_type`` when it first sees labels), and
    Dynamo guards a capture on the value it read, so the second call failed the guard and was
    captured and planned again. Known by class (a ``transformers`` ``PreTrainedModel``), without
    importing transformers.
    """
    return _is_hf_model(model)


def _is_hf_model(module: nn.Module) -> bool:
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
        for c in type(module).__mro__
    )


def _caches_in_training(model: nn.Module, forward: Callable[..., Any]) -> bool:
    """Whether ``model`` is (or wraps, as peft does) a HuggingFace encoder-decoder that returns a
    key/value cache from training calls (``config.use_cache``), and its ``forward`` takes
    ``use_cache``: memfit then calls it with ``use_cache=False`` in training, as HF's own
    gradient checkpointing does.

    Why: an encoder-decoder's cache holds every decoder layer's cross-attention keys and values,
    computed from the encoder's output, all alive when the forward ends; a training step never
    reads them. memfit's "memory" on T5 (CPU, fp32, width 256, 4+4 layers, batch 8 x 128)
    peaked at 75.7 MiB with the cache, against 64.7 MiB for HF's checkpointing (which turns it
    off) and 63.7 for memfit without it. Not for decoder-only models: their cache is the keys and
    values the backward keeps anyway, and without a cache HF builds its causal mask explicitly
    under ``torch.compile`` and repeats grouped keys and values (Llama, ``"none"``: 111.8 MiB
    without the cache against eager's and its own 103.8 with it)."""
    hf = next((m for m in model.modules() if _is_hf_model(m)), None)
    config = getattr(hf, "config", None)
    if getattr(config, "use_cache", None) is not True:
        return False
    if getattr(config, "is_encoder_decoder", None) is not True:
        return False
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False
    return "use_cache" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _mark_output_hook(module: nn.Module, args: Any, out: Any) -> Any:
    if _capturing and torch.compiler.is_compiling():
        return _mark_tree(out)
    return None


@dataclasses.dataclass(frozen=True)
class _Settings:
    """What ``memfit.checkpoint`` was asked for, resolved: kept to apply memfit to a copy."""

    policy: Policy
    options: Options
    executor: Executor


class Checkpointing(PlannedView):
    """memfit's state on one model (``model.memfit``): the plan, the policy, the original
    ``forward``, and the hooks that turn listed submodules' outputs into marks."""

    def __init__(
        self, model: nn.Module, base_class: type[nn.Module], prior_forward: Any, settings: _Settings
    ) -> None:
        #: the class the model had before memfit (``memfit.remove`` puts it back)
        self.base_class = base_class
        #: an instance ``forward`` someone set before memfit (accelerate's autocast wrapper), or
        #: None: the class's own
        self.prior_forward = prior_forward
        self.original_forward: Callable[..., Any] = (
            prior_forward
            if prior_forward is not None
            else types.MethodType(base_class.forward, model)
        )
        #: the ``forward`` memfit set on the model (None for a copy made with another one on top)
        self.installed: Any = None
        self.settings = settings
        self._planned = PlannedCall(
            self.original_forward,
            settings.policy,
            settings.options,
            settings.executor,
            name=base_class.__name__,
            modules=model,
        )
        named = dict(model.named_modules())
        #: (submodule name, hook handle) per listed submodule
        self.hooks = [
            (name, named[name].register_forward_hook(_mark_output_hook))
            for name in settings.policy.modules
        ]
        self._model = model
        self._settled = not _settles_on_first_call(model)
        #: training calls get ``use_cache=False``, as under HF's gradient checkpointing (an
        #: encoder-decoder's cache: ``_caches_in_training``)
        self._no_cache = _caches_in_training(model, self.original_forward)
        #: flags that would make the model run code only ``torch.compile`` runs (``eager_paths``)
        self._switches = compile_only_switches(model)

    @property
    def regions_changed(self) -> bool:
        """Whether the last call chose submodules to recompute whole (graph breaks inside
        them), which apply from the next call on."""
        return self._planned.regions_changed

    def remove(self) -> None:
        """Take memfit off the model (``memfit.remove``)."""
        remove(self._model)

    def release(self) -> None:
        """Drop the hooks, and the offload store unless a backward still needs what it holds
        (then its finalizer removes the files when it is collected, or at exit)."""
        for _, hook in self.hooks:
            hook.remove()
        store = self.offload_store
        if store is not None and not store.slots:
            store.close()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's ``forward`` while memfit is applied."""
        if torch.compiler.is_compiling() and memfit_call_running():
            # Inside another memfit call, traced by its capture: the model is part of the outer
            # call's graphs and planned by its policy, as any other submodule. Stepping around it
            # there broke the outer graph, and inside a loop (an nn.Sequential) Dynamo gave up
            # on the whole frame: the outer model ran unplanned.
            return self.original_forward(*args, **kwargs)
        if not torch.is_grad_enabled():
            # Evaluation, torch.no_grad(), generate(): nothing is kept for a backward, so there
            # is nothing to plan; plain PyTorch, exactly.
            return self.original_forward(*args, **kwargs)
        return self._call(*args, **kwargs)

    @torch.compiler.disable
    def _call(self, *args: Any, **kwargs: Any) -> Any:
        """A training call of its own. Excluded from an outer ``torch.compile``."""
        global _capturing
        if self._no_cache and self._model.training and "use_cache" not in kwargs:
            kwargs = {**kwargs, "use_cache": False}
        if not self._settled:
            # Let the first call's attribute changes happen before Dynamo captures (see
            # ``_settles_on_first_call``): one eager forward without autograd, its buffer updates
            # and random draws undone, so the step itself is exactly the user's.
            self._settled = True
            model = self._model
            with (
                torch.no_grad(),
                preserved(model.buffers(), generators=owned_generators(model.modules())),
            ):
                self.original_forward(*args, **kwargs)
        _capturing += 1
        try:
            with eager_paths(self._switches):
                return self._planned.run(*args, **kwargs)  # this method steps around Dynamo
        finally:
            _capturing -= 1

    def __repr__(self) -> str:
        return f"memfit.checkpoint({self.base_class.__name__}, policy={self.policy.label!r})"


@dataclasses.dataclass
class _Pickled:
    """What ``CheckpointedModule.__reduce_ex__`` keeps of a model: its own state, and memfit's
    settings to apply to the copy (None: memfit was not applied to this instance)."""

    state: Any
    settings: _Settings | None = None
    #: (submodule name, hook id) of memfit's mark hooks, copied with the submodules: removed
    hooks: tuple[tuple[str, int], ...] = ()
    #: whether the copy gets memfit's ``forward`` (False: another one wraps it, copied as is)
    install: bool = True
    prior_forward: Any = None


class CheckpointedModule:
    """The class every model memfit is applied to also becomes an instance of.

    ``memfit.checkpoint(model)`` turns ``type(model)`` into a subclass of this and of the model's
    own class (``_checkpointed_class``), so ``isinstance(model, memfit.CheckpointedModule)`` tells
    whether memfit is applied, and ``model.memfit`` reaches its state. It adds nothing else to the
    model's namespace.
    """

    @property
    def memfit(self) -> Checkpointing:
        """memfit's state on this model: ``plan``, ``policy``, ``remove()``."""
        state = self.__dict__.get(_STATE)
        if state is None:  # made from memfit's class (a slice of an nn.Sequential), not applied
            raise AttributeError(f"memfit is not applied to this {type(self).__name__}")
        return state

    # NOTE [copies of a model memfit is applied to]
    # copy.deepcopy and pickling (torch.save) copy the model as its own class and apply memfit to
    # the copy again: compiled graphs are not copied, the copy plans on its first training call,
    # and loading needs memfit importable. The copy is made first (``_new``) and its state set
    # after (``__setstate__``), as for any object, so references back to the model inside its
    # state (a hook bound to it) point at the copy.
    def __reduce_ex__(self, protocol: Any) -> Any:
        base = _base_class(type(self))
        getstate = getattr(self, "__getstate__", None)
        state = getstate() if getstate is not None else self.__dict__.copy()
        pickled = _Pickled(state)
        memfit = state.get(_STATE) if isinstance(state, dict) else None
        if memfit is not None:
            state = dict(state)
            del state[_STATE]
            ours = _ours(state.get("forward"), memfit, self)
            if ours and memfit.prior_forward is None:
                del state["forward"]
            elif ours:
                state["forward"] = memfit.prior_forward
            hooks = tuple((name, hook.id) for name, hook in memfit.hooks)
            pickled = _Pickled(state, memfit.settings, hooks, ours, memfit.prior_forward)
        return (_new, (base,), pickled)

    def __setstate__(self, pickled: _Pickled) -> None:
        model: Any = self  # an nn.Module: the class memfit made is a subclass of one
        base = _base_class(type(model))
        model.__class__ = base  # its own state is set by its own class
        setstate = getattr(model, "__setstate__", None)
        if setstate is not None:
            setstate(pickled.state)
        else:
            model.__dict__.update(pickled.state)
        if pickled.settings is None:
            return
        for name, hook in pickled.hooks:
            model.get_submodule(name)._forward_hooks.pop(hook, None)
        if pickled.install:
            _apply(model, pickled.settings)
        else:
            model.__dict__[_STATE] = Checkpointing(
                model, base, pickled.prior_forward, pickled.settings
            )
            model.__class__ = _checkpointed_class(base)


def _new(base: type[nn.Module]) -> nn.Module:
    """An empty instance of memfit's class of ``base``, its state set by ``__setstate__``."""
    cls = _checkpointed_class(base)
    return cls.__new__(cls)


#: memfit's subclass of each model class it was applied to (one per class, as FSDP2 keeps)
_classes: dict[type, type] = {}


def _checkpointed_class(base: type[nn.Module]) -> type[nn.Module]:
    """``base`` with ``CheckpointedModule`` mixed in, under ``base``'s own name and module: the
    name is what frameworks record (HF writes ``config.architectures`` from it)."""
    cls = _classes.get(base)
    if cls is None:
        cls = type(
            base.__name__,
            (CheckpointedModule, base),
            {"__module__": base.__module__, "__qualname__": base.__qualname__},
        )
        _classes[base] = cls
    return cls


def _base_class(cls: type) -> type[nn.Module]:
    """The model's own class behind memfit's subclass of it."""
    for base, checkpointed in _classes.items():
        if checkpointed is cls:
            return base
    for base in cls.__mro__[1:]:  # a subclass of memfit's class, made by someone else
        if issubclass(base, nn.Module) and not issubclass(base, CheckpointedModule):
            return base
    raise TypeError(f"{cls.__name__} is not a class memfit made")


def _install_forward(model: nn.Module, original: Callable[..., Any]) -> Any:
    """Set ``model.forward`` to run through ``model.memfit``, and return it.

    It has the original's name, docstring and signature (``__signature__``: HF ``Trainer`` keeps
    the dataset columns ``inspect.signature(model.forward)`` names), but no ``__wrapped__``:
    accelerate's ``unwrap_model(keep_fp32_wrapper=False)`` follows ``__wrapped__`` down to the
    innermost function and installs that, which would have stepped around memfit. It stays a
    bound method where the original was one (accelerate reads ``model.forward.__func__``). It
    looks the state up at each call, so applying memfit again only replaces the state."""
    if isinstance(original, types.MethodType):

        @functools.wraps(original.__func__)
        def method(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return self.__dict__[_STATE](*args, **kwargs)

        forward: Any = method
        signature_of: Any = original.__func__
    else:

        @functools.wraps(original)
        def function(*args: Any, **kwargs: Any) -> Any:
            return model.__dict__[_STATE](*args, **kwargs)

        forward = function
        signature_of = original
    del forward.__wrapped__
    try:
        forward.__signature__ = inspect.signature(signature_of)
    except (TypeError, ValueError):  # no signature to read (a builtin): none to keep either
        pass
    bound = isinstance(original, types.MethodType)
    installed = types.MethodType(forward, model) if bound else forward
    model.__dict__["forward"] = installed
    return installed


def _ours(forward: Any, state: Checkpointing, model: object) -> bool:
    """Whether ``forward`` is the one memfit installed (or the same function bound to the model
    again, as accelerate's ``unwrap_model`` rebinds the innermost one it finds)."""
    installed = state.installed
    if forward is installed:
        return True
    return (
        isinstance(forward, types.MethodType)
        and isinstance(installed, types.MethodType)
        and forward.__func__ is installed.__func__
        and forward.__self__ is model
    )


def _apply(model: M, settings: _Settings) -> M:
    """Apply memfit to ``model`` under ``settings`` (again: a new state, same class and forward)."""
    previous: Checkpointing | None = model.__dict__.get(_STATE)
    if previous is not None:
        previous.release()
        state = Checkpointing(model, previous.base_class, previous.prior_forward, settings)
        state.installed = previous.installed
        model.__dict__[_STATE] = state
        return model
    made = isinstance(model, CheckpointedModule)  # an instance of memfit's class, not applied
    base = _base_class(type(model)) if made else type(model)
    state = Checkpointing(model, base, model.__dict__.get("forward"), settings)
    model.__dict__[_STATE] = state
    state.installed = _install_forward(model, state.original_forward)
    # mypy reads __class__ as type[M]: the subclass memfit makes is one
    model.__class__ = _checkpointed_class(base)  # type: ignore[assignment]
    return model


def remove(model: M) -> M:
    """Take memfit off ``model``: its class, ``forward`` and hooks as before
    ``memfit.checkpoint``, its compiled graphs and offloaded files released. Returns the model."""
    state: Checkpointing | None = model.__dict__.get(_STATE)
    if not isinstance(model, CheckpointedModule) or state is None:
        raise TypeError(
            f"memfit is not applied to this {type(model).__name__}: nothing to remove "
            f"(isinstance(model, memfit.CheckpointedModule) tells)"
        )
    if type(model) is not _classes.get(state.base_class):
        raise TypeError(
            f"this {type(model).__name__}'s class was changed after memfit was applied "
            f"(to {type(model).__qualname__} from {type(model).__module__}, e.g. by FSDP2's "
            f"fully_shard): memfit cannot be removed from under it; apply memfit last, or "
            f"remove it before"
        )
    if not _ours(model.__dict__.get("forward"), state, model):
        raise TypeError(
            f"this {type(model).__name__}'s forward was replaced after memfit was applied (as "
            f"accelerate's prepare does for mixed precision): memfit cannot be removed from "
            f"under it; remove memfit before, or apply it last"
        )
    state.release()
    if state.prior_forward is None:
        del model.__dict__["forward"]
    else:
        model.__dict__["forward"] = state.prior_forward
    del model.__dict__[_STATE]
    model.__class__ = state.base_class
    return model


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
    model: M,
    policy: PolicyLike = "memory",
    *,
    offload: bool = False,
    executor: Executor | str = Executor.EAGER,
    options: Options | None = None,
) -> M:
    """Apply memfit to ``model`` in place, so its training steps keep fewer activations and
    recompute (or offload) the rest; returns ``model`` itself, as FSDP2's ``fully_shard`` does.

    The model stays the user's: same object, class checks, parameters, ``state_dict``,
    attributes and methods, ``inspect.signature(model.forward)``. ``model.memfit`` holds memfit's
    state (``model.memfit.plan`` after the first training call). Calls without autograd
    (``torch.no_grad()``, ``generate``) run plain PyTorch. ``memfit.remove(model)`` takes memfit
    off; applying it again replaces the earlier policy. Copies (``copy.deepcopy``, pickling) have
    memfit applied again.

    ``policy``: what to keep for backward (everything else is recomputed):

    - ``"memory"`` (default): the least activation memory, each forward op recomputed at most once
    - ``"speed"``: outputs of matmul, convolution and attention; cheap ops recomputed
    - ``"collection"``: the tensors marked with ``memfit.mark``
    - ``"none"``: everything (plain autograd)
    - ``"swap"``: everything, offloading what can hide behind compute
    - a list of submodule names (as in ``named_modules()``) whose outputs are kept
    - a budget: ``int`` bytes, a size (``"2GiB"``) or a ``float`` fraction in (0, 1] of the
      activations plain autograd keeps. memfit keeps what makes recomputation cheapest while
      the predicted peak of the whole step stays within it, and raises ``memfit.BudgetError``
      (with the least reachable peak) on the first training call if nothing fits.

    ``offload=True`` lets ``"memory"`` or a budget also offload saved values (to host memory on
    CUDA, to disk on CPU), the cheapest mix that fits. ``executor="inductor"`` compiles the plan
    with Inductor (``torch.compile``'s speed, results to floating-point tolerance); the default
    ``"eager"`` runs it on eager's kernels, losses and gradients bit for bit plain PyTorch's.
    ``options`` (``memfit.Options``) holds the rest: attention rewriting, offload destination,
    autotuning, the number of input shapes captured. docs/policies.md says more.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"memfit.checkpoint expects an nn.Module, got {type(model).__name__}")
    settings = _resolved(policy, offload, executor, options)
    _validate_names(model, settings.policy.modules)
    if isinstance(policy, (list, tuple)) and not settings.policy.modules:
        warnings.warn(
            "an empty list of submodules marks nothing: every activation will be recomputed",
            stacklevel=2,
        )
    # applied again: the new policy replaces the old, as a second model.compile() does
    return _apply(model, settings)


def _resolved(
    policy: PolicyLike, offload: bool, executor: Executor | str, options: Options | None
) -> _Settings:
    return _Settings(*resolve(policy, offload, executor, options))


def plan(
    model: nn.Module,
    *example_inputs: Any,
    policy: PolicyLike = "memory",
    offload: bool = False,
    executor: Executor | str = Executor.EAGER,
    options: Options | None = None,
    device: str | torch.device | Device | None = None,
    **example_kwargs: Any,
) -> Plan:
    """The plan ``memfit.checkpoint(model, policy, ...)`` would run on these inputs, without
    training. Takes exactly ``checkpoint``'s arguments, and the ``device`` to plan for.

    Runs one forward of ``model`` on the example inputs under the plan (so the call itself stays
    within a budget), then restores every buffer (BatchNorm running statistics) and every
    random-number state a forward draws from (torch's CPU and CUDA, Python's ``random``,
    ``numpy.random``, generators the model's modules hold), so the model and later random
    draws are exactly as before; no
    backward runs and no gradient is touched. The plan has ``predicted_peak_bytes``,
    ``recompute_flops``, ``kept``/``recomputed`` and ``pareto()``. Raises ``BudgetError`` when a
    budget cannot be met.

    ``device`` (``"cpu"``, ``"cuda"``, a ``torch.device``, or a named GPU such as
    ``"h100-80gb"`` / a ``memfit.Device``, planned for its type): where the step will run; by
    default where the model lives. A model built under ``torch.device("meta")`` (or meta
    inputs), or a ``device`` other than the model's, is planned on fake tensors for that device
    (``execution.fake_target``): nothing is allocated, and the model is left as it was given.
    A meta model needs ``device``.
    """
    if _STATE in model.__dict__:
        raise TypeError(
            f"memfit.plan plans a model memfit is not applied to; this {type(model).__name__} "
            f"has memfit applied: read model.memfit.plan after a training call, or call "
            f"memfit.remove(model) first"
        )
    target = fake_target(model, (example_inputs, example_kwargs), device)
    if target is None:
        return _plan(model, example_inputs, example_kwargs, policy, offload, executor, options)
    with on_fake_target(
        model,
        example_inputs,
        example_kwargs,
        target,
        offload=offload,
        executor=str(executor),
        options=options,
    ) as (args, kwargs, fake_options):
        return _plan(model, args, kwargs, policy, offload, executor, fake_options)


def _plan(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    policy: PolicyLike,
    offload: bool,
    executor: Executor | str,
    options: Options | None,
) -> Plan:
    """``plan``'s work: memfit applied for one capture, and removed again."""
    checkpoint(model, policy, offload=offload, executor=executor, options=options)
    state: Checkpointing = model.__dict__[_STATE]
    try:
        with (
            preserved(model.buffers(), generators=owned_generators(model.modules())),
            torch.enable_grad(),
        ):
            model(*args, **kwargs)
            # Graph breaks: the step planned again as a whole, and submodules recomputed whole
            # (execution.regions) from the call after they were found.
            for _ in range(STEP_ROUNDS + 1):
                if not (state.replan_pending or state.regions_changed):
                    break
                model(*args, **kwargs)
        return state.plan
    finally:
        remove(model)
