"""What a training step holds besides activations: weights, gradients, optimizer state and the
optimizer's own temporaries, computed from the parameters alone.

Why a formula and not a measurement: the question "will it fit" is asked of a model built under
``torch.device("meta")``, whose parameters have sizes and dtypes but no storage, for a device
that is not here. So each figure is read off ``model.parameters()`` and ``model.buffers()``:

- weights: every parameter and buffer, in its dtype (a model in bf16 holds bf16 weights; under
  autocast the weights stay fp32 and the bf16 copies autocast makes are activations, in the plan);
- gradients: one per parameter that requires grad, in the parameter's dtype;
- optimizer state, created at the first ``step()`` and held from then on: SGD with momentum one
  buffer per parameter (a clone of its gradient); Adam and AdamW ``exp_avg`` and ``exp_avg_sq``
  per parameter, plus a float32 ``step`` scalar per parameter where torch keeps it on the
  parameters' device (fused or capturable, or any implementation on CPU; the CUDA foreach and
  for-loop paths keep it on the host);
- temporaries inside ``step()``, as torch 2.13's ``torch/optim/adam.py`` and ``sgd.py``
  allocate them (NOTE [Optimizer temporaries]).

Sizes go through ``round_bytes`` tensor by tensor: identity on CPU, the CUDA caching allocator's
block (``analysis.devices.CudaAllocator.allocated_bytes``) for a CUDA device. Against
``memfit.measure`` of a real ``optimizer.step()`` on CPU the state is exact and the temporaries
are exact but for torch's scalar tensors (12 B measured: the learning-rate and step constants
each implementation makes), which are not counted.

NOTE [Optimizer temporaries]
    The implementation matters: torch picks ``foreach`` by default when every parameter is on
    CUDA, the single-tensor loop (``for-loop``) on CPU, and ``fused`` only when asked.
    - Adam/AdamW ``foreach``: per group of parameters of one dtype, ``exp_avg_sq_sqrt =
      _foreach_sqrt(exp_avg_sqs)`` holds one tensor per parameter of the group; the previous
      group's list is freed only when the name is rebound, so the peak is the largest sum of two
      consecutive groups. Adam's (coupled) weight decay first makes ``_foreach_add(grads,
      params)``, deleted before the square root: it never adds to that peak.
    - Adam/AdamW ``for-loop``: per parameter, ``denom = (exp_avg_sq.sqrt() / bc).add_(eps)``
      makes two tensors of its size while the previous parameter's ``denom`` is still bound:
      the peak is the largest ``previous + 2 x current``; Adam's weight decay (``grad =
      grad.add(param)``) adds one more ``current``.
    - ``fused``: one kernel updates in place; no temporaries.
    - SGD: with weight decay ``grad.add(param)`` (for-loop: one parameter at a time; foreach: a
      whole group); momentum updates its buffer in place. Nesterov is not modelled.
    Measured on CPU with ``memfit.measure`` (tests/test_step_memory.py) for each case.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["OPTIMIZERS", "IMPLEMENTATIONS", "StepMemory", "step_memory", "default_implementation"]

#: The optimizers modelled, with torch's default weight decay of each.
OPTIMIZERS: dict[str, float] = {"sgd": 0.0, "adam": 0.0, "adamw": 1e-2}
#: The implementations modelled (torch's ``foreach=``/``fused=`` arguments).
IMPLEMENTATIONS = ("for-loop", "foreach", "fused")


@dataclass(frozen=True)
class StepMemory:
    """Bytes a training step holds besides activations, each as ``round_bytes`` counts it."""

    #: parameters and buffers
    weights_bytes: int
    #: one gradient per parameter that requires grad
    gradient_bytes: int
    #: held from the first ``optimizer.step()`` on
    optimizer_state_bytes: int
    #: the most ``optimizer.step()`` allocates above its state while it runs
    optimizer_temp_bytes: int
    #: ``"sgd"``, ``"adam"``, ``"adamw"`` or ``"none"``
    optimizer: str = "none"
    #: ``"for-loop"``, ``"foreach"`` or ``"fused"`` (``""`` without an optimizer)
    implementation: str = ""

    @property
    def optimizer_step_bytes(self) -> int:
        """Above weights and state while ``optimizer.step()`` runs: gradients and temporaries."""
        return self.gradient_bytes + self.optimizer_temp_bytes


def default_implementation(device_type: str) -> str:
    """The implementation torch picks with ``foreach=None, fused=None``: ``foreach`` on CUDA,
    the single-tensor loop elsewhere (``torch.optim.optimizer._default_to_fused_or_foreach``)."""
    return "foreach" if device_type == "cuda" else "for-loop"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _consecutive_peak(groups: list[int]) -> int:
    """The largest sum of a group and the one before it (or the first group alone)."""
    return max((groups[i] + (groups[i - 1] if i else 0) for i in range(len(groups))), default=0)


def step_memory(
    model: nn.Module | Iterable[nn.Parameter],
    optimizer: str = "adamw",
    *,
    implementation: str | None = None,
    device_type: str = "cuda",
    weight_decay: float | None = None,
    round_bytes: Callable[[int], int] | None = None,
) -> StepMemory:
    """Weights, gradients, optimizer state and step temporaries of training ``model``.

    Args:
        model: the model (parameters and buffers counted) or its parameters (no buffers).
            Meta tensors work: only sizes and dtypes are read.
        optimizer: ``"sgd"`` (with momentum), ``"adam"``, ``"adamw"``, or ``"none"``.
        implementation: ``"for-loop"``, ``"foreach"`` or ``"fused"``; None: what torch picks
            on ``device_type`` (``default_implementation``).
        device_type: where the step runs, ``"cuda"`` or ``"cpu"``: decides torch's default and
            whether Adam's ``step`` scalars live on the device.
        weight_decay: None: torch's default for the optimizer (AdamW 1e-2, others 0).
        round_bytes: bytes one tensor of ``n`` bytes takes (the device allocator's block);
            None: ``n``.

    Raises ``ValueError`` for an optimizer or implementation not modelled, naming those that are.
    """
    name, impl = _checked(optimizer, implementation, device_type)
    decay = OPTIMIZERS.get(name, 0.0) if weight_decay is None else weight_decay
    size = round_bytes or (lambda n: n)
    if isinstance(model, nn.Module):
        params = list(model.parameters())
        buffers = list(model.buffers())
    else:
        params, buffers = list(model), []
    weights = sum(size(_nbytes(t)) for t in (*params, *buffers))
    trained = [p for p in params if p.requires_grad]
    per_param = [size(_nbytes(p)) for p in trained]
    grads = sum(per_param)
    if name == "none" or not trained:
        return StepMemory(weights, grads, 0, 0, name, "" if name == "none" else impl)

    groups: dict[torch.dtype, int] = {}
    for p, n in zip(trained, per_param):
        groups[p.dtype] = groups.get(p.dtype, 0) + n
    group_sums = list(groups.values())

    if name == "sgd":
        state = grads  # one momentum buffer per parameter
        temps = _sgd_temps(decay, impl, group_sums, per_param)
    else:
        state, temps = _adam_state_temps(
            name, decay, impl, device_type, per_param, group_sums, size
        )
    return StepMemory(weights, grads, state, temps, name, impl)


def _checked(optimizer: str, implementation: str | None, device_type: str) -> tuple[str, str]:
    """The optimizer's name and implementation, checked to be modelled."""
    name = optimizer.lower()
    if name not in (*OPTIMIZERS, "none"):
        raise ValueError(
            f"optimizer {optimizer!r} is not modelled; memfit counts the state and step "
            f"temporaries of {', '.join(OPTIMIZERS)} (or 'none': weights and gradients only)"
        )
    impl = default_implementation(device_type) if implementation is None else implementation
    if impl not in IMPLEMENTATIONS:
        raise ValueError(
            f"optimizer implementation {implementation!r} is not modelled; use one of "
            f"{', '.join(IMPLEMENTATIONS)} (torch's foreach=True, fused=True, or neither)"
        )
    return name, impl


def _sgd_temps(decay: float, impl: str, group_sums: list[int], per_param: list[int]) -> int:
    """SGD's step temporaries: a weight-decayed gradient, per parameter or per dtype group."""
    if decay == 0 or impl == "fused":
        return 0
    if impl == "foreach":
        return max(group_sums)
    return max(per_param)


def _adam_state_temps(
    name: str,
    decay: float,
    impl: str,
    device_type: str,
    per_param: list[int],
    group_sums: list[int],
    size: Callable[[int], int],
) -> tuple[int, int]:
    """Adam's and AdamW's state (two moments, and the step scalars where they live on the
    device) and step temporaries."""
    steps_on_device = impl == "fused" or device_type != "cuda"
    state = 2 * sum(per_param) + (len(per_param) * size(4) if steps_on_device else 0)
    coupled_decay = name == "adam" and decay != 0
    if impl == "fused":
        temps = 0
    elif impl == "foreach":
        temps = _consecutive_peak(group_sums)
    else:
        extra = 1 if coupled_decay else 0
        temps = max(
            (per_param[i - 1] if i else 0) + (2 + extra) * per_param[i]
            for i in range(len(per_param))
        )
    return state, temps
