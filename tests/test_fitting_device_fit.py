"""memfit.fit: the whole step's peak against a measured training step on CPU, the largest batch
against plans of the sizes around it, and what it says when nothing fits."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import memfit
from memfit.analysis.devices import Device
from memfit.analysis.step_memory import step_memory
from memfit.fitting.device_fit import StepPeak
from memfit.fitting.step_plan import plan_step
from memfit.planning.policy import parse_policy

MIB = 2**20


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.GELU()) for _ in range(4)])


def _host(capacity: int) -> Device:
    """This machine as a device: plans, measurements and the optimizer's defaults are CPU's."""
    return Device("host", "this CPU", "cpu", capacity, {"float32": 1e11}, 2e10, 2e10, 0)


@pytest.mark.slow
@pytest.mark.parametrize(("optimizer", "batch"), [("adamw", 16), ("sgd", 512)])
def test_the_whole_step_peak_is_a_measured_training_step(optimizer: str, batch: int) -> None:
    """Above what a step starts with (weights, the batch, the optimizer state), the measured
    peak of forward, backward, ``optimizer.step()`` and ``zero_grad()`` under the plan is the
    larger of the plan's peak and the gradients with the step's temporaries. AdamW at a small
    batch: the optimizer's moment is the peak; SGD at a large one: the backward's."""
    model = _mlp()
    x = torch.randn(batch, 128)
    plan = plan_step(model, (x,), {}, parse_policy("none"), "cpu")
    memory = step_memory(model, optimizer, device_type="cpu")
    predicted = StepPeak(memory, x.numel() * 4, plan.predicted_peak_bytes)
    opt = (torch.optim.AdamW if optimizer == "adamw" else torch.optim.SGD)(
        model.parameters(), lr=0.01, **({"momentum": 0.9} if optimizer == "sgd" else {})
    )

    def train_step() -> None:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    memfit.checkpoint(model, "none")  # the plan measured runs
    train_step()  # the state is made
    measured = memfit.measure(train_step).peak_bytes
    assert measured is not None
    above = predicted.peak_bytes - predicted.held_bytes
    if optimizer == "adamw":
        assert predicted.memory.optimizer_step_bytes > plan.predicted_peak_bytes
        assert 0 <= measured - above <= 64  # torch's scalars in step()
    else:
        assert plan.predicted_peak_bytes > predicted.memory.optimizer_step_bytes
        # the plan's own margin: 2.50 MiB predicted, 2.25 MiB measured (planning's, not this sum)
        assert measured <= above <= 1.15 * measured


@pytest.mark.slow
def test_the_largest_batch_fits_and_the_next_does_not() -> None:
    model, x = _mlp(), torch.randn(32, 128)
    device = _host(6 * MIB)
    report = memfit.fit(model, x, device=device, policies=["none"], optimizer="adamw")
    (row,) = report.rows
    assert row.fits and row.exact and row.largest_batch is not None
    assert row.plans <= 6
    memory = step_memory(model, "adamw", device_type="cpu")
    for size, fits in ((row.largest_batch, True), (row.largest_batch + 1, False)):
        plan = plan_step(model, (torch.randn(size, 128),), {}, parse_policy("none"), "cpu")
        peak = StepPeak(memory, size * 128 * 4, plan.predicted_peak_bytes).peak_bytes
        assert (peak <= device.usable_bytes) == fits
    data = report.to_dict()
    assert data["device"] == "host" and data["rows"][0]["largest_batch"] == row.largest_batch
    assert set(data["rows"][0]) >= {
        "policy", "batch", "peak_bytes", "fits", "largest_batch", "step_seconds"
    }  # fmt: skip


def test_a_batch_that_fits_nowhere_says_what_would() -> None:
    model, x = _mlp(), torch.randn(64, 128)
    weights = sum(p.numel() * 4 for p in model.parameters())
    tiny = _host(3 * weights)  # weights, gradients, and AdamW's two states do not fit
    report = memfit.fit(model, x, device=tiny, policies=["memory"], optimizer="adamw")
    assert not report.fits and report.rows[0].largest_batch == 0
    message = report.no_fit_message()
    assert message is not None
    assert "batch 64 fits under no policy on host" in message
    assert "not even batch 1 fits" in message and "alone take" in message
    assert report.rows[0].plans == 1  # the optimizer alone rules every batch out: no search


def test_fit_refuses_what_it_cannot_plan() -> None:
    with pytest.raises(ValueError, match="unknown device 'tpu-v9'.*h100-80gb"):
        memfit.fit(_mlp(), torch.randn(2, 128), device="tpu-v9")
    with pytest.raises(ValueError, match="optimizer 'lamb' is not modelled"):
        memfit.fit(_mlp(), torch.randn(2, 128), optimizer="lamb")


def test_a_part_of_a_device() -> None:
    device = dataclasses.replace(memfit.Device.named("l4"), capacity_bytes=600 * MIB)
    report = memfit.fit(_mlp(), torch.randn(8, 128), device=device, policies=["none"], search=False)
    (row,) = report.rows
    assert device.usable_bytes == 88 * MIB  # less the CUDA context
    assert row.fits and row.largest_batch is None and row.plans == 1
    held = row.weights_bytes + row.input_bytes + row.optimizer_bytes
    moments = (row.activation_bytes, row.optimizer_temp_bytes)
    assert row.peak_bytes == held + row.gradient_bytes + max(moments)
    assert row.step_seconds is not None and row.step_seconds > 0
    assert report.planned_on == "cpu" and report.implementation == "foreach"


@pytest.mark.slow
def test_autocast_plans_bf16_activations_beside_fp32_weights() -> None:
    """Under autocast the weights, gradients and AdamW's state stay fp32; the activations the
    plan keeps are bf16: at a batch where they dominate, about half of fp32's."""
    model, x = _mlp(), torch.randn(1024, 128)
    rows = [
        memfit.fit(model, x, device=_host(2**30), policies=["none"], search=False,
                   autocast=cast).rows[0]
        for cast in (None, torch.bfloat16)
    ]  # fmt: skip
    fp32, bf16 = rows
    assert (fp32.weights_bytes, fp32.gradient_bytes, fp32.optimizer_bytes) == (
        bf16.weights_bytes, bf16.gradient_bytes, bf16.optimizer_bytes
    )  # fmt: skip
    assert 0.4 * fp32.activation_bytes < bf16.activation_bytes < 0.7 * fp32.activation_bytes
