"""Planning for a device memfit does not run on: the model and its inputs as fake tensors.

``memfit.plan(model, *inputs, device=...)`` answers for a model too large for this machine (built
under ``torch.device("meta")``: a 6.7B Llama in under a second) or for a device it does not have
(``device="cuda"`` on a CPU-only machine). The plan is made the way it is made for a real model
(Dynamo, AOTAutograd, the planner, the simulation), on tensors that have shapes, strides and
dtypes but no storage: under one ``FakeTensorMode`` every parameter, buffer and input is
replaced by a fake tensor for the duration of the call, then put back, so no parameter or
activation is allocated and the model is left exactly as it was given (its parameters stay on
meta). The fake tensors are CPU stand-ins (``STAND_IN`` says why), and each graph's bytes are
counted as the target's allocator takes them.

What memfit otherwise learns by running real tensors has a model here, chosen for the target
device type: op scratch memory (``analysis.op_scratch.modelled_op_scratch``), never measured on
this machine; the allocator's rounding (``JointGraph.place_on``); nothing is measured outside
memfit's graphs (``Options.measure_outside``: there is
no step, and ``memfit.plan`` runs no backward). A plan that needs a measurement of this machine
is refused with what to pass instead: offload measures the link (``Options(offload_bandwidth=)``
names it), and ``executor="inductor"`` measures its compiled graphs.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from memfit._compat import (
    FAKE_VALUE_ERRORS,
    FakeTensorMode,
    is_fake,
    own_tensor_tables,
    tree_flatten,
    tree_map,
)
from memfit.analysis.devices import Device, get_device, known_devices
from memfit.execution.executors import INDUCTOR
from memfit.execution.options import Options

__all__ = [
    "DEVICE_TYPES",
    "fake_target",
    "is_meta",
    "on_fake_target",
    "parse_device",
    "planning_target",
]

#: The device types a plan can be made for (planning on fake tensors included).
DEVICE_TYPES = ("cpu", "cuda")


#: The device a plan on fake tensors is being made for (None: none is being made).
_target: torch.device | None = None


def planning_target() -> torch.device | None:
    """The device the model now planned on fake tensors will run on; None outside such a plan.
    The partitioner counts the graph's bytes for it and models its ops' scratch for it."""
    return _target


def parse_device(device: str | torch.device | Device) -> torch.device:
    """``device`` as a ``torch.device`` memfit can plan for, or ``ValueError`` saying why.

    A named device (``"h100-80gb"``, ``memfit.Device``) plans for its type (``"cuda"``): its
    capacity, FLOP/s and context are ``memfit.fit``'s business, the bytes of the step the
    same on every GPU of one allocator."""
    if isinstance(device, Device):
        return torch.device(device.type)
    if isinstance(device, str):
        try:
            parsed = torch.device(device)
        except (RuntimeError, ValueError):
            try:
                return torch.device(get_device(device).type)
            except ValueError:
                raise ValueError(
                    f"memfit.plan(device={device!r}): not a device torch knows nor a named one; "
                    f"plan for one of {', '.join(map(repr, DEVICE_TYPES))}, a torch.device such "
                    f"as torch.device('cuda', 0), or a named GPU: {', '.join(known_devices())}"
                ) from None
    elif isinstance(device, torch.device):
        parsed = device
    else:
        raise TypeError(
            f"memfit.plan(device=...) takes a string or a torch.device, got "
            f"{type(device).__name__} ({device!r:.60})"
        )
    if parsed.type not in DEVICE_TYPES:
        raise ValueError(
            f"memfit.plan(device={device!r}): memfit plans for {' or '.join(DEVICE_TYPES)} "
            f"devices, not {parsed.type!r}; pass device='cuda' to plan for a GPU"
        )
    return parsed


def _tensors(model: nn.Module, inputs: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(inputs)
    return [
        *model.parameters(),
        *model.buffers(),
        *(t for t in leaves if isinstance(t, torch.Tensor)),
    ]


def is_meta(model: nn.Module, inputs: Any = ()) -> bool:
    """Whether any of ``model``'s parameters and buffers or the tensors in ``inputs`` (any
    pytree) is on the meta device: no storage, so the model is planned on fake tensors."""
    return any(t.is_meta for t in _tensors(model, inputs))


def fake_target(
    model: nn.Module, inputs: Any, device: str | torch.device | Device | None
) -> torch.device | None:
    """The device to plan ``model`` for on fake tensors, or None to plan it as it runs here.

    On fake tensors: a model or input on the meta device (then ``device`` is required), or a
    ``device`` of another type than the one the model lives on (a CPU model planned for CUDA).
    A real model with no ``device``, or one naming where it lives, is planned as today.
    """
    target = parse_device(device) if device is not None else None
    if is_meta(model, inputs):
        if target is None:
            raise ValueError(
                f"this {type(model).__name__} has parameters, buffers or inputs on the meta "
                f"device, which hold no values to run: memfit plans it on fake tensors for the "
                f"device it will train on; say which, e.g. memfit.plan(model, *inputs, "
                f"device='cuda')"
            )
        return target
    tensors = _tensors(model, inputs)
    if any(is_fake(t) for t in tensors):
        raise ValueError(
            "memfit.plan takes a model and inputs on a real device or on meta, not fake "
            "tensors: build the model under torch.device('meta') and pass device=, and memfit "
            "makes the fake tensors itself"
        )
    if target is None:
        return None
    here = {t.device.type for t in tensors}
    return None if here <= {target.type} else target


def _check_options(offload: bool, executor: str, options: Options | None) -> Options:
    """``options`` for a plan on fake tensors: nothing measured outside memfit's graphs, and a
    refusal for what only a measurement of this machine decides."""
    options = options or Options()
    if executor == INDUCTOR:
        raise ValueError(
            "memfit.plan(..., device=...) on meta or fake tensors predicts the eager executor: "
            "executor='inductor' measures its compiled graphs by running them; plan with "
            "executor='eager'"
        )
    if offload and options.offload_bandwidth is None:
        raise ValueError(
            "memfit.plan(..., offload=True) on meta or fake tensors needs the link's bandwidth "
            "(memfit measures it by copying real tensors on this machine, which is not the "
            "target): pass options=memfit.Options(offload_bandwidth=...) in bytes per second"
        )
    return dataclasses.replace(options, measure_outside=False)


#: The device fake tensors are made on. On the CPU-only torch 2.13 wheel, fake CUDA tensors
#: run matrix products and attention but not an op that takes a device guard (indexing with
#: ``None``, ``copy_``: "PyTorch is not linked with support for cuda devices"), which every HF
#: model's rotary or position code does; so a model is traced on CPU stand-ins and its graphs
#: counted for the target (``planning_target``): its allocator's rounding, its ops' scratch.
STAND_IN = torch.device("cpu")


@contextlib.contextmanager
def on_fake_target(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device: torch.device,
    *,
    offload: bool,
    executor: str,
    options: Options | None,
) -> Iterator[tuple[tuple[Any, ...], dict[str, Any], Options]]:
    """Inside: ``model``'s parameters and buffers are fake tensors (on ``STAND_IN``) under one
    ``FakeTensorMode`` (active), ``planning_target()`` is ``device``, and the yielded inputs and
    options are the ones to plan with; on exit the model's own tensors are back, the same
    objects.

    A parameter shared by several modules (tied weights) stays one fake parameter, so the plan
    sees the tie; each keeps its ``requires_grad``.
    """
    global _target
    if _target is not None:
        raise RuntimeError("memfit.plan on fake tensors is already running (one at a time)")
    options = _check_options(offload, executor, options)
    mode = FakeTensorMode()
    made: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            with mode:
                empty = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=STAND_IN)
            if isinstance(t, nn.Parameter):
                made[id(t)] = nn.Parameter(empty, requires_grad=t.requires_grad)
            else:
                made[id(t)] = empty.requires_grad_(t.requires_grad) if t.is_leaf else empty
        return made[id(t)]

    swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    try:
        for module in model.modules():
            for table in own_tensor_tables(module):
                for name, t in table.items():
                    if t is not None:
                        swapped.append((table, name, t))
        for table, name, t in swapped:
            table[name] = fake(t)
        inputs = tree_map(lambda v: fake(v) if isinstance(v, torch.Tensor) else v, (args, kwargs))
        _target = device
        with mode:
            yield inputs[0], inputs[1], options
    except FAKE_VALUE_ERRORS as err:
        raise ValueError(
            f"{type(model).__name__} reads a tensor's value while it runs (.item(), "
            f"nonzero, a branch on a tensor: {err}), which fake tensors do not have, so it "
            f"cannot be planned on meta: plan the real model (at a smaller size if it does not "
            f"fit), or keep the value out of the forward"
        ) from err
    finally:
        _target = None
        for table, name, t in swapped:
            table[name] = t
