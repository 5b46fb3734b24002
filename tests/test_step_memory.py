"""memfit.step_memory against memfit.measure of real optimizer steps on CPU.

The state is compared after the first ``step()`` (its ``end_bytes``), the temporaries on the
second (its ``peak_bytes``, with the state already alive). torch's implementations also make a
few scalar tensors in ``step()`` (12 B measured) that the model does not count: ``SCALARS``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memfit
from conftest import CUDA
from memfit.analysis.devices import allocated_bytes
from memfit.analysis.step_memory import default_implementation, step_memory

#: Bytes of scalar tensors torch's optimizers make inside ``step()``, not modelled.
SCALARS = 64

_CLASSES = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def _net(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32), nn.LayerNorm(32)).to(
        dtype
    )


def _optimizer(model: nn.Module, name: str, impl: str, decay: float) -> torch.optim.Optimizer:
    kwargs: dict[str, object] = {"lr": 0.1, "weight_decay": decay}
    kwargs.update({"foreach": True} if impl == "foreach" else {"foreach": False})
    if impl == "fused":
        kwargs = {"lr": 0.1, "weight_decay": decay, "fused": True}
    if name == "sgd":
        kwargs["momentum"] = 0.9
    return _CLASSES[name](model.parameters(), **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "impl", "decay", "dtype"),
    [
        # the fast tier: two; the full suite: every case
        ("adam", "for-loop", 0.1, torch.float32),  # coupled decay: one more temporary
        ("adamw", "foreach", 0.01, torch.float32),
        *(
            pytest.param(*case, marks=pytest.mark.slow)
            for case in [
                ("sgd", "for-loop", 0.1, torch.float32),
                ("adamw", "fused", 0.01, torch.float32),
                ("sgd", "for-loop", 0.0, torch.float32),
                ("sgd", "foreach", 0.1, torch.float32),
                ("sgd", "fused", 0.1, torch.float32),
                ("adam", "for-loop", 0.0, torch.float32),
                ("adam", "foreach", 0.1, torch.float32),
                ("adam", "fused", 0.0, torch.float32),
                ("adamw", "for-loop", 0.01, torch.float32),
                ("adamw", "foreach", 0.01, torch.bfloat16),  # pure bf16: state in bf16
                ("adam", "for-loop", 0.0, torch.bfloat16),
            ]
        ),
    ],
    ids=lambda v: str(v).removeprefix("torch."),
)
def test_state_and_temporaries_match_a_measured_step(
    name: str, impl: str, decay: float, dtype: torch.dtype
) -> None:
    model = _net(dtype)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer = _optimizer(model, name, impl, decay)
    first = memfit.measure(optimizer.step)
    second = memfit.measure(optimizer.step)
    predicted = step_memory(model, name, implementation=impl, device_type="cpu", weight_decay=decay)
    assert first.end_bytes == predicted.optimizer_state_bytes
    assert second.peak_bytes is not None and first.peak_bytes is not None
    assert 0 <= second.peak_bytes - predicted.optimizer_temp_bytes <= SCALARS
    # the first step builds its state as it goes: state and temporaries bound it
    assert (
        first.peak_bytes
        <= predicted.optimizer_state_bytes + predicted.optimizer_temp_bytes + SCALARS
    )
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert predicted.weights_bytes == predicted.gradient_bytes == params


def test_foreach_temporaries_of_two_dtype_groups_overlap() -> None:
    """A model with an fp32 and a bf16 group: the first group's square roots are freed only when
    the second's are made (NOTE [Optimizer temporaries])."""
    model = _net()
    model[3].to(torch.bfloat16)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer = _optimizer(model, "adamw", "foreach", 0.01)
    optimizer.step()
    measured = memfit.measure(optimizer.step).peak_bytes
    predicted = step_memory(model, "adamw", implementation="foreach", device_type="cpu")
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert predicted.optimizer_temp_bytes == params  # both groups at once
    assert measured is not None and 0 <= measured - params <= SCALARS


def test_meta_parameters_give_the_same_figures() -> None:
    real = _net(torch.bfloat16)
    with torch.device("meta"):
        meta = _net(torch.bfloat16)
    for name in ("sgd", "adam", "adamw"):
        assert step_memory(meta, name) == step_memory(real, name)


def test_frozen_parameters_have_no_gradient_nor_state() -> None:
    model = _net()
    model[0].requires_grad_(False)
    frozen = sum(p.numel() * p.element_size() for p in model[0].parameters())
    full = step_memory(_net(), "adam", device_type="cpu")
    part = step_memory(model, "adam", device_type="cpu")
    assert part.weights_bytes == full.weights_bytes
    assert part.gradient_bytes == full.gradient_bytes - frozen
    assert part.optimizer_state_bytes == full.optimizer_state_bytes - 2 * frozen - 2 * 4


def test_buffers_are_weights_and_cuda_rounds_each_tensor() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))  # 9 + 3 + 3 + 3 floats, 3 buffers
    m = step_memory(model, "adamw", device_type="cuda", round_bytes=allocated_bytes)
    assert m.implementation == "foreach" == default_implementation("cuda")
    assert m.weights_bytes == 7 * 512  # 4 parameters, 3 buffers (num_batches_tracked too)
    assert m.gradient_bytes == 4 * 512
    assert m.optimizer_state_bytes == 2 * 4 * 512  # the step scalars stay on the host
    fused = step_memory(model, "adamw", implementation="fused", round_bytes=allocated_bytes)
    assert fused.optimizer_state_bytes == 2 * 4 * 512 + 4 * 512
    assert fused.optimizer_temp_bytes == 0


def test_what_is_not_modelled_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'lion' is not modelled.*sgd, adam, adamw"):
        step_memory(_net(), "lion")
    with pytest.raises(ValueError, match="implementation 'triton' is not modelled"):
        step_memory(_net(), "adam", implementation="triton")
    none = step_memory(_net(), "none")
    assert none.optimizer_state_bytes == none.optimizer_temp_bytes == 0


@CUDA
def test_adamw_state_on_a_gpu_is_rounded_per_tensor() -> None:
    """On a GPU: torch's default (foreach) AdamW's state, measured, is the rounded state with
    the step scalars on the host."""
    model = _net().cuda()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(model.parameters())
    first = memfit.measure(optimizer.step)
    second = memfit.measure(optimizer.step)
    predicted = step_memory(model, "adamw", round_bytes=allocated_bytes)
    assert first.end_bytes == predicted.optimizer_state_bytes
    assert second.peak_bytes is not None
    assert 0 <= second.peak_bytes - predicted.optimizer_temp_bytes <= 4 * 512
