"""Regions: submodules Dynamo cannot capture, recomputed whole in the backward pass.

Where Dynamo cannot trace a module's forward (a Python ``if`` on a tensor's value, an untraceable
call), it splits the forward into graphs and runs the code between them as ordinary Python.
memfit plans each graph, but the Python between them saves its activations with plain autograd,
and a value that crosses a break is an input of the next graph, which keeps it for free as far
as its plan is concerned: on a model with a data-dependent branch in each of 8 layers
(``tests/test_regions.py``), ``"memory"`` peaked at 0.72x plain PyTorch, against 0.36x for the
same layers without the branch, captured as one graph. No plan over the graphs can reach those
values; recomputing each layer whole, 0.29-0.30x.

So memfit does at the module level what ``torch.utils.checkpoint`` does, and with it: a module
whose call Dynamo could not trace runs, from the call after the break was found, under
non-reentrant ``torch.utils.checkpoint.checkpoint`` (``use_reentrant=False``). Its saved-tensor
hooks see every tensor anything inside the call saves, memfit's compiled graphs (their
``CompiledFunction``'s saved values) and the eager Python between them alike, and keep none: the
backward runs the module's forward again, Python included, with the random states of the forward
(torch's by ``preserve_rng_state=True``: dropout draws the same masks; Python's and numpy's by
``_Recomputing``: masks its Python draws are drawn again alike, NOTE [ Random streams a forward
draws from ] in ``execution.state``), then its graphs' backward as planned, and every random
state is put back as the forward left it. Only the call's inputs are kept.

NOTE [ Finding the regions ]
A module is a region when a memfit graph was compiled while its call was running eagerly: Dynamo
traces a module call into its caller's graph, so a module called through ``nn.Module.__call__``
from running Python is one whose call broke its caller's graph (``_compat.eager_module_calls``,
asked from the backend). The root model is always called so and is never a region: recomputing
the whole model keeps nothing less. Of nested ones (a block whose attention breaks) the innermost
are chosen, so the rest of the block stays in graphs memfit plans. Observed when Dynamo hands
the backend a graph and, for the rest of that call, whenever a graph runs: Dynamo compiles a
layer's forward once and reuses its graphs for the other layers of its class, which are then
seen running. Calls that compile nothing (every step after the first of each shape) walk no
stack.

NOTE [ How a region runs ]
While a memfit call runs, the region module's ``forward`` is an instance attribute (restored
afterwards, so the user's own calls and ``torch.save(model)`` see the model as it was): a
function Dynamo does not trace (``torch.compiler.disable``) that calls ``checkpoint`` on the
module's own forward, compiled by the wrapper with a second backend that plans every graph with
``"none"``: the region's recomputation is then the one recomputation of its ops, as ``"memory"``
promises (each op recomputed at most once). Planning the graphs inside with the wrapper's policy
would recompute them twice for a little less memory: on the 8-layer test model, with
``"memory"`` inside, 0.25x plain's peak at 1.46x the step time of ``"none"`` inside, which
peaks at 0.29x (one run, CPU). The first regioned call plans these graphs again, once; their
keys are those of the first call's graphs, so they count as no new input shape.
``checkpoint``'s ``context_fn`` gives the recomputation a context that puts the module's buffers
back when it ends (BatchNorm statistics are updated by the forward, not again by the
recomputation) and tells the wrapper that the backward has started (its measurement of what the
loss holds between forward and backward ends there, before the recomputation allocates).

Policies: ``"memory"`` and budgets recompute regions (a budget cannot see what a region's Python
allocates, so it can only be honoured with it recomputed; the step's budget counts each region as
one fixed part, ``planning.step_budget``); a list of submodule names recomputes
every region not strictly containing a listed module (a listed region's output is kept, as the
list asks); ``"none"``, ``"speed"`` (which never recomputes a matmul), ``"collection"`` with marks
(a mark inside a region would be recomputed) and offloading plans recompute none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn
import torch.utils.checkpoint

from memfit._compat import (
    compile_with_recompile_limit,
    eager_module_calls,
    numpy_random_in_python,
    tree_flatten,
)
from memfit.execution.state import RandomStates, owned_generators, preserved
from memfit.planning.plan import GraphPlan, RegionPlan
from memfit.planning.policy import Policy

__all__ = ["DYNAMO_RECOMPILE_LIMIT", "Regions", "choose_regions", "recomputes_regions"]

#: Dynamo's limit on compiled variants per code object for memfit's own ``torch.compile`` calls
#: (``recompile_limit=``): the wrapper's ``max_shapes`` binds first. Dynamo's default, 8, is
#: shared by every compiled module in the process (they enter through one code object).
DYNAMO_RECOMPILE_LIMIT = 1 << 16


def recomputes_regions(policy: Policy) -> bool:
    """Whether ``policy`` recomputes modules with graph breaks whole (see the module docstring)."""
    if policy.offload:
        return False
    if policy.chooses_what_to_keep:
        return True
    return bool(policy.modules)


def choose_regions(observed: Iterable[str], policy: Policy) -> tuple[str, ...]:
    """The modules to recompute whole: of the ``observed`` module names (called eagerly with a
    graph compiled inside, ``""`` the root), the innermost, filtered by ``policy``."""
    if not recomputes_regions(policy):
        return ()
    names = sorted(set(observed) - {""})
    inner = [n for n in names if not any(m.startswith(n + ".") for m in names)]
    return tuple(n for n in inner if not any(m.startswith(n + ".") for m in policy.modules))


def _inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, list[torch.Generator]]:
    """Bytes of the tensors autograd made among a call's inputs, one count per storage (what a
    checkpoint keeps that would otherwise be free: parameters and the batch are alive anyway),
    and the ``torch.Generator`` objects among them (its recomputation must draw what it drew)."""
    leaves, _ = tree_flatten((args, kwargs))
    storages: dict[int, int] = {}
    generators = []
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(t, torch.Generator):
            generators.append(t)
    return sum(storages.values()), generators


class _Recomputing:
    """The context a region's recomputation runs in: the wrapper is told the backward started;
    Python's, numpy's and the module's own generators' random states are those the forward
    started with (``drawn``: its Python draws again what it drew); numpy's random functions are
    left to Python as in the forward (``numpy_random_in_python``); the module's buffers and
    those random states are put back when it ends. Torch's global generators ``checkpoint``
    replays itself (``preserve_rng_state``). A class, not a generator, so a second backward
    through the same graph (``retain_graph=True``) can enter it again."""

    def __init__(self, module: nn.Module, started: Callable[[], None], drawn: RandomStates) -> None:
        self._module = module
        self._started = started
        self._drawn = drawn
        self._restore: contextlib.ExitStack | None = None

    def __enter__(self) -> None:
        self._started()
        self._restore = contextlib.ExitStack()
        self._restore.enter_context(preserved(self._module.buffers(), random=False))
        now = RandomStates(torch_streams=False, generators=[g for g, _ in self._drawn.generators])
        self._restore.callback(now.restore)
        self._drawn.restore()
        self._restore.enter_context(numpy_random_in_python())

    def __exit__(self, *exc: object) -> None:
        if self._restore is not None:
            self._restore.close()
            self._restore = None


class _Region:
    """One module recomputed whole: its replacement ``forward`` and its compiled own forward."""

    def __init__(self, owner: Regions, name: str, module: nn.Module) -> None:
        self.name = name
        self.module = module
        code = type(module).forward.__code__
        self.kind = type(module).__name__
        self.where = f"{code.co_filename}:{code.co_firstlineno}"
        self._owner = owner
        self._runner: Callable[..., Any] | None = None
        self._saved: Any = None  # an instance ``forward`` the user set, restored after each call
        self.forward = torch.compiler.disable(self._forward)
        #: generators its modules own, drawn from again by its recomputation
        self._generators = owned_generators(module.modules())

    def runner(self) -> Callable[..., Any]:
        """The module's own forward, compiled with the wrapper's current backend."""
        if self._runner is None:
            own = self._saved if self._saved is not None else type(self.module).forward
            bound = own if self._saved is not None else own.__get__(self.module)
            self._runner = compile_with_recompile_limit(
                bound, backend=self._owner.backend, dynamic=False, limit=DYNAMO_RECOMPILE_LIMIT
            )
        return self._runner

    def reset(self) -> None:
        self._runner = None

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        run = self.runner()
        if not torch.is_grad_enabled():
            return run(*args, **kwargs)
        first = len(self._owner.ran)
        nbytes, passed = _inputs(args, kwargs)
        # what its Python draws from, as the forward starts (torch's global generators:
        # checkpoint's own)
        drawn = RandomStates(torch_streams=False, generators=[*self._generators, *passed])
        recomputing = _Recomputing(self.module, self._owner.recompute_started, drawn)
        out = torch.utils.checkpoint.checkpoint(
            run,
            *args,
            use_reentrant=False,
            preserve_rng_state=True,
            context_fn=lambda: (contextlib.nullcontext(), recomputing),
            **kwargs,
        )
        graphs = tuple(range(first, len(self._owner.ran)))
        self._owner.calls.append(RegionPlan(self.name, self.kind, self.where, nbytes, graphs))
        return out

    def install(self) -> None:
        self._saved = self.module.__dict__.get("forward")
        self.module.__dict__["forward"] = self.forward

    def remove(self) -> None:
        if self._saved is None:
            self.module.__dict__.pop("forward", None)
        else:
            self.module.__dict__["forward"] = self._saved


class Regions:
    """The regions of one wrapped model: observed, chosen, and installed around each call.

    ``ran`` is the wrapper's list of the graphs the current call ran (a region's call records
    which of them ran inside it); ``recompute_started`` is called when the backward starts
    recomputing a region.
    """

    def __init__(
        self,
        model: nn.Module,
        ran: list[GraphPlan],
        recompute_started: Callable[[], None],
    ) -> None:
        self.ran = ran
        self.recompute_started = recompute_started
        self.backend: Any = None
        #: the region calls of the current memfit call, in order
        self.calls: list[RegionPlan] = []
        #: modules called eagerly with a graph compiled inside, by name (``""``: the root)
        self.observed: set[str] = set()
        self.chosen: dict[str, _Region] = {}
        self._model = model
        self._names = {id(m): name for name, m in model.named_modules()}
        self._watching = False  # a graph was compiled during this call: observe every run
        self._decided = 0  # len(observed) at the last decision (it only grows)

    def use(self, backend: Any) -> None:
        """Compile regions with ``backend`` from now on (the wrapper made a new one)."""
        self.backend = backend
        for region in self.chosen.values():
            region.reset()

    def compiling(self) -> None:
        """Called by the backend as Dynamo hands it a graph: note the modules running eagerly,
        and keep noting them at every graph run until the call ends."""
        self._watching = True
        self._observe()

    def graph_ran(self) -> None:
        """A memfit graph runs: note the modules around it if this call compiled anything."""
        if self._watching:
            self._observe()

    def _observe(self) -> None:
        for module in eager_module_calls():
            name = self._names.get(id(module))
            if name is not None:
                self.observed.add(name)

    def decide(self, policy: Policy) -> bool:
        """Choose the regions ``policy`` recomputes from what was observed; True if they changed
        (from the next call).

        Asked after every call; nothing new observed (every step once compiled) is the same
        choice, so it is not made again (choosing sorts every name observed: 4-6 us a step).
        """
        if len(self.observed) == self._decided:
            return False
        self._decided = len(self.observed)
        names = choose_regions(self.observed, policy)
        if tuple(self.chosen) == names:
            return False
        modules = dict(self._model.named_modules())
        self.chosen = {
            name: self.chosen.get(name) or _Region(self, name, modules[name]) for name in names
        }
        return True

    @property
    def modules_with_breaks(self) -> tuple[str, ...]:
        """The innermost modules with a break in them, whether or not the policy recomputes
        them."""
        return choose_regions(self.observed, Policy("memory"))

    def describe(self) -> str:
        """The chosen regions for a message: names (abbreviated) and where their forward is."""
        names = list(self.chosen)
        shown = ", ".join(names) if len(names) <= 3 else f"{names[0]}, ... {names[-1]}"
        places = "; ".join(
            dict.fromkeys(f"{r.kind}.forward at {r.where}" for r in self.chosen.values())
        )
        return f"{shown} ({places})"

    def installed(self) -> _Installed:
        """The chosen regions run as regions while the context is open (one memfit call)."""
        return _Installed(self)


class _Installed:
    """``Regions.installed``: a class, not a generator, since every call opens one (a generator
    context costs microseconds a step)."""

    __slots__ = ("regions", "installed")

    def __init__(self, regions: Regions) -> None:
        self.regions = regions
        self.installed: list[_Region] = []

    def __enter__(self) -> None:
        regions = self.regions
        regions.calls.clear()
        regions._watching = False
        self.installed = list(regions.chosen.values())
        for region in self.installed:
            region.install()

    def __exit__(self, *exc: object) -> None:
        self.regions._watching = False
        for region in self.installed:
            region.remove()
