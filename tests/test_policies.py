"""What each policy keeps, checked by exact memory accounting of real training steps.

The O(√n) chain is the original project's own test; the ResNet, U-Net and LSTM ratios are the
claims in the README. All peaks come from ``memfit.measure`` (CPU allocator events), never from
the planner's own prediction.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn

import memfit
from memfit.bench.zoo import cifar_resnet, lstm, tanh_chain, unet

MB = 2**20


def _step_peak(model: nn.Module, x: torch.Tensor, loss: Callable[[Any], torch.Tensor]) -> int:
    """Peak bytes of one training step, after a first (capturing) step."""
    loss(model(x)).backward()
    for p in model.parameters():
        p.grad = None
    x.grad = None

    def step() -> None:
        loss(model(x)).backward()

    peak = memfit.measure(step).peak_bytes
    assert peak is not None
    return peak


def _mean_square(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


@pytest.mark.parametrize("n", [100, pytest.param(400, marks=pytest.mark.slow)])
def test_tanh_chain_memory_is_sqrt_n(n: int) -> None:
    """OpenAI's test: n tanh layers of 1 MB; "memory" peaks at <= 2.5*sqrt(n) MB + 3 MB."""
    model = tanh_chain(n)
    x = torch.randn(512, 512, requires_grad=True)  # 1 MiB per activation
    wrapped = memfit.checkpoint(model, "memory")
    peak = _step_peak(wrapped, x, lambda out: out.sum())
    assert peak <= (2.5 * math.sqrt(n) + 3) * MB, f"peak {peak / MB:.1f} MB at n={n}"
    torch.compiler.reset()
    plain = _step_peak(memfit.checkpoint(tanh_chain(n), "none"), x, lambda out: out.sum())
    assert plain >= n * MB  # without checkpointing every layer's output is kept


def test_collection_keeps_exactly_the_marks() -> None:
    class Chain5(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a1 = torch.tanh(x)
            a1 = memfit.mark(a1)
            a2 = torch.tanh(a1)
            a3 = memfit.mark(torch.tanh(a2))
            a4 = torch.tanh(a3)
            return torch.tanh(a4)

    wrapped = memfit.checkpoint(Chain5(), "collection")
    x = torch.randn(256, 256, requires_grad=True)
    wrapped(x).sum().backward()
    plan = wrapped.memfit.plan
    kept_tanh = [name for name in plan.kept if name.startswith("tanh")]
    assert kept_tanh == ["tanh", "tanh_2"], plan.kept  # a1 and a3, nothing else
    assert plan.kept_bytes == 2 * 256 * 256 * 4
    # gradients are still those of plain PyTorch
    expected = torch.autograd.grad(Chain5()(x).sum(), x)[0]
    torch.testing.assert_close(x.grad, expected)


def test_marks_are_identity_outside_capture() -> None:
    t = torch.randn(3)
    assert memfit.mark(t) is t
    with pytest.raises(TypeError, match="torch.Tensor"):
        memfit.mark([t])  # type: ignore[arg-type]


def test_module_names_keep_those_outputs() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(6)])
    x = torch.randn(32, 64)
    wrapped = memfit.checkpoint(model, ["1", "3"])
    wrapped(x).sum().backward()
    kept_tanh = [n for n in wrapped.memfit.plan.kept if n.startswith("tanh")]
    assert kept_tanh == ["tanh_1", "tanh_3"], wrapped.memfit.plan.kept


@pytest.mark.parametrize(
    "name, make, shape, max_ratio",
    [
        ("resnet110", lambda: cifar_resnet(18), (32, 3, 32, 32), 0.25),
        ("unet", lambda: unet(depth=3, width=8, convs_per_block=4), (8, 1, 128, 128), 0.5),
        ("lstm", lambda: lstm(steps=32, hidden_size=64), (128, 32, 16), 0.5),
    ],
)
def test_memory_mode_ratio(
    name: str, make: Callable[[], nn.Module], shape: tuple[int, ...], max_ratio: float
) -> None:
    torch.manual_seed(0)
    x = torch.randn(*shape)
    plain = _step_peak(memfit.checkpoint(make(), "none"), x, _mean_square)
    torch.compiler.reset()
    wrapped = memfit.checkpoint(make(), "memory")
    saved = _step_peak(wrapped, x, _mean_square)
    ratio = saved / plain
    assert ratio <= max_ratio, (
        f"{name}: memory mode peak {saved / MB:.1f} MB is {ratio:.3f} of none"
    )
    # the prediction is about the same quantity the measurement reports
    assert abs(wrapped.memfit.plan.predicted_peak_bytes - saved) <= 0.1 * saved


def test_speed_mode_keeps_heavy_outputs_and_saves_memory() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(256, 256), nn.LayerNorm(256), nn.GELU()) for _ in range(8)]
    )
    x = torch.randn(256, 256)
    plain = _step_peak(memfit.checkpoint(model, "none"), x, _mean_square)
    torch.compiler.reset()
    wrapped = memfit.checkpoint(model, "speed")
    speed = _step_peak(wrapped, x, _mean_square)
    assert speed < plain
    assert all(not name.startswith(("addmm", "mm")) for name in wrapped.memfit.plan.recomputed)
    assert any(name.startswith("gelu") for name in wrapped.memfit.plan.recomputed)


class _CausalLM(nn.Module):
    """A tiny HF causal LM trained on its own tokens: the loss comes from labels, so the logits
    and the key/value cache are outputs that no gradient reaches."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> Any:
        return self.model(input_ids=ids, labels=ids)


def _hf_step_peak(model: nn.Module, name: str) -> int:
    ids = torch.randint(0, 100, (8, 64), generator=torch.Generator().manual_seed(0))
    if name == "bert":
        return _step_peak(model, ids, lambda out: out.last_hidden_state.square().mean())
    return _step_peak(model, ids, lambda out: out.loss)


@pytest.mark.parametrize("name", ["transformer", "gpt2"])
def test_none_peaks_as_eager_on_the_zoo(name: str) -> None:
    """Policy "none" keeps what eager autograd keeps: no copy for a dropout with p=0 (the
    transformer), no zero gradients for outputs the loss does not read."""
    from memfit.bench import zoo

    case = zoo.case(name)
    args, kwargs = case.make_inputs()
    eager = zoo.measured_step_peak(case, case.make_model(), args, kwargs)
    wrapped = memfit.checkpoint(case.make_model(), "none")
    peak = zoo.measured_step_peak(case, wrapped, args, kwargs)
    assert peak <= 1.02 * eager, f"{name}: none peaks at {peak / eager:.3f}x eager"


@pytest.mark.parametrize("attention", ["off", "auto"])
@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_none_peaks_as_eager_on_huggingface(name: str, attention: str) -> None:
    pytest.importorskip("transformers")
    from hf_models import tiny_hf

    def make() -> nn.Module:
        model = tiny_hf(name).train()
        if name == "bert":
            return model
        model.loss_type = "ForCausalLM"  # GPT2LMHeadModel's own name matches no loss: a break
        return _CausalLM(model)

    eager = _hf_step_peak(make(), name)
    peak = _hf_step_peak(
        memfit.checkpoint(make(), "none", options=memfit.Options(attention=attention)), name
    )
    assert peak <= 1.02 * eager, f"{name}: none peaks at {peak / eager:.3f}x eager"


@pytest.mark.slow
def test_none_peaks_as_eager_on_a_rotary_llama_given_its_padding_mask() -> None:
    """Given an all-ones ``attention_mask``, as a tokenizer returns it, HF's Llama in eager
    passes ``is_causal=True`` and ``enable_gqa=True`` to SDPA and keeps no mask; under Dynamo the
    mask is a traced tensor it cannot skip, so the captured graph builds a float mask per layer
    and repeats the key/value heads, both kept for SDPA's backward. "none" still peaks no higher
    than eager (the mask made again from the inputs in the backward, ``keep_rules.input_derived``;
    the heads passed unrepeated, ``capture.attention.gqa``), equals its gradients and predicts
    its own peak."""
    pytest.importorskip("transformers")
    from hf_models import tiny_hf
    from memfit.bench.runner import Method, first_step

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (8, 64), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    def measured(model: nn.Module) -> tuple[int, dict[str, torch.Tensor]]:
        def step() -> None:
            model(**batch).loss.backward()  # the output dropped before backward, as Trainer does

        method = Method("step", model, step, record_failures=False)
        first_step(method)
        method.zero_grad()
        peak = memfit.measure(step).peak_bytes
        assert peak is not None
        return peak, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    eager, eager_grads = measured(tiny_hf("llama", "sdpa").train())
    wrapped = memfit.checkpoint(tiny_hf("llama", "sdpa").train(), "none")
    peak, grads = measured(wrapped)
    assert peak <= eager, f"none peaks at {peak / eager:.3f}x eager ({peak} > {eager} bytes)"
    assert abs(wrapped.memfit.plan.predicted_peak_bytes - peak) <= 0.01 * peak
    assert grads.keys() == eager_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], msg=name)


class _SharedBiasStack(nn.Module):
    """Repeated blocks that all read one value computed before them (as T5's blocks read its
    position bias and a decoder's its encoder output): no small cut in the forward order."""

    def __init__(self, width: int = 64, depth: int = 6) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bias = nn.Linear(width, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(depth)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.tanh(self.bias(x))
        for block in self.blocks:
            x = x + block(x * shared)
        return x


def test_memory_peaks_at_most_as_high_as_per_block_checkpointing() -> None:
    """The plan users write by hand, ``torch.utils.checkpoint`` around every block, is one of
    the plans ``"memory"`` chooses from (``policies.keep_blocks``): measured, it is never lower."""
    from torch.utils.checkpoint import checkpoint

    x = torch.randn(256, 64)
    model = _SharedBiasStack()

    def by_hand(inp: torch.Tensor) -> torch.Tensor:
        shared = torch.tanh(model.bias(inp))
        for block in model.blocks:
            inp = inp + checkpoint(lambda h, b=block: b(h * shared), inp, use_reentrant=False)
        return inp

    _mean_square(by_hand(x)).backward()
    model.zero_grad(set_to_none=True)
    hand = memfit.measure(lambda: _mean_square(by_hand(x)).backward()).peak_bytes
    assert hand is not None
    wrapped = memfit.checkpoint(_SharedBiasStack(), "memory")
    ours = _step_peak(wrapped, x, _mean_square)
    assert ours <= hand
    # and in the simulation: the per-block plan is found from the module paths, and the
    # frontier's least peak ("memory") is at most its peak
    from memfit.analysis.simulate import simulate_step
    from memfit.bench.graphs import joint_graphs
    from memfit.planning.frontier import pareto_frontier
    from memfit.planning.keep_rules import keep_blocks

    (jg,) = joint_graphs(_SharedBiasStack(), x)
    blocks = keep_blocks(jg)
    assert blocks is not None
    least = min(p.peak_bytes for p in pareto_frontier(jg))
    assert least <= simulate_step(jg, blocks).peak_bytes
