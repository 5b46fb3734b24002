"""``memfit.plan`` on meta models and fake tensors (``execution.fake_target``): the same bytes
as the plan of the real model, nothing allocated, the model left as it was given, and clear
errors for what it cannot plan."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

import memfit
from memfit.bench.zoo import MLP, ZOO, case
from memfit.execution.fake_target import is_meta


def _meta(value: Any) -> Any:
    return value.to("meta") if isinstance(value, torch.Tensor) else value


def _meta_case(name: str) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    """The zoo case built under ``torch.device("meta")``, with its inputs on meta."""
    c = case(name)
    args, kwargs = c.make_inputs()
    with torch.device("meta"):
        model = c.make_model()
    return model, tuple(map(_meta, args)), {k: _meta(v) for k, v in kwargs.items()}


def _real_plan(name: str, policy: Any) -> memfit.Plan:
    c = case(name)
    args, kwargs = c.make_inputs()
    plan = memfit.plan(c.make_model(), *args, policy=policy, **kwargs)
    torch.compiler.reset()
    return plan


#: Zoo models whose plans on fake tensors differ from the real ones, and why: an op whose CPU
#: scratch is not modelled (NOTE [Op scratch on fake tensors]). The fake plan counts none of it,
#: so it is at most the real one, and at least this fraction of it (measured on torch 2.13,
#: 2 threads: resnet 0.75, unet 0.84, densenet 0.91, inplace_relu 0.73 under "memory").
NOT_MODELLED = {
    "resnet": 0.7,  # oneDNN's convolution workspaces
    "unet": 0.7,
    "densenet": 0.7,
    "inplace_relu": 0.7,
}
#: CPU flash attention's backward keeps per-thread blocks of a few KiB, not modelled: "memory"'s
#: peak is at that op (576 B of 135 KiB on the zoo's transformer).
ATTENTION_BACKWARD_BYTES = 8 * 1024


#: The fast tier plans the MLP only (each case plans twice, seconds each); ``make test`` all.
FAST = ("mlp",)


@pytest.mark.parametrize("policy", ["none", "memory"])
@pytest.mark.parametrize(
    "name",
    [c.name if c.name in FAST else pytest.param(c.name, marks=pytest.mark.slow) for c in ZOO],
)
def test_a_meta_zoo_model_is_planned_as_its_real_self(name: str, policy: str) -> None:
    model, args, kwargs = _meta_case(name)
    params = list(model.parameters())
    fake = memfit.plan(model, *args, policy=policy, device="cpu", **kwargs)
    torch.compiler.reset()
    assert list(model.parameters()) == params and all(p.is_meta for p in params)
    real = _real_plan(name, policy)
    assert len(fake.graphs) == len(real.graphs)
    if name in NOT_MODELLED:
        low = NOT_MODELLED[name] * real.predicted_peak_bytes
        assert low <= fake.predicted_peak_bytes <= real.predicted_peak_bytes
    elif name == "transformer" and policy == "memory":
        gap = real.predicted_peak_bytes - fake.predicted_peak_bytes
        assert 0 <= gap <= ATTENTION_BACKWARD_BYTES
    else:
        assert fake.predicted_peak_bytes == real.predicted_peak_bytes
        assert fake.kept_bytes == real.kept_bytes
        assert fake.recompute_flops == real.recompute_flops


@pytest.mark.slow
def test_a_byte_budget_is_met_alike_on_meta() -> None:
    """A budget between "memory"'s and "none"'s peaks chooses the same plan on meta."""
    none, memory = _real_plan("mlp", "none"), _real_plan("mlp", "memory")
    budget = (none.predicted_peak_bytes + memory.predicted_peak_bytes) // 2
    real = _real_plan("mlp", budget)
    model, args, kwargs = _meta_case("mlp")
    fake = memfit.plan(model, *args, policy=budget, device="cpu", **kwargs)
    assert fake.predicted_peak_bytes == real.predicted_peak_bytes <= budget
    assert fake.kept == real.kept


def _tiny_llama(device: str | None = None, vocab: int = 100) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=vocab,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    if device is None:
        return transformers.LlamaForCausalLM(config).train()
    with torch.device(device):
        return transformers.LlamaForCausalLM(config).train()


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["none", "memory"])
def test_a_meta_llama_from_a_config_is_planned_as_its_real_self(policy: str) -> None:
    ids = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(0))
    real = memfit.plan(_tiny_llama(), input_ids=ids, labels=ids, policy=policy)
    torch.compiler.reset()
    meta = ids.to("meta")
    model = _tiny_llama("meta")
    fake = memfit.plan(model, input_ids=meta, labels=meta, policy=policy, device="cpu")
    assert fake.predicted_peak_bytes == real.predicted_peak_bytes
    assert fake.kept_bytes == real.kept_bytes
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.slow
def test_a_meta_llama_whose_loss_head_is_chunked_is_planned_as_its_real_self() -> None:
    """512 tokens of a 2048 vocabulary: the loss head is rewritten to memfit's chunked kernel,
    whose blocks a fake plan cannot measure and counts by their rule (a few KiB above)."""
    ids = torch.randint(0, 2048, (2, 256), generator=torch.Generator().manual_seed(0))
    real = memfit.plan(_tiny_llama(vocab=2048), input_ids=ids, labels=ids, policy="none")
    assert real.loss_heads and real.loss_heads[0].fused
    torch.compiler.reset()
    meta = ids.to("meta")
    model = _tiny_llama("meta", vocab=2048)
    fake = memfit.plan(model, input_ids=meta, labels=meta, policy="none", device="cpu")
    assert 0 <= fake.predicted_peak_bytes - real.predicted_peak_bytes <= 16 * 1024


def test_planning_on_meta_allocates_nothing() -> None:
    """Measured around the whole call: what is allocated while memfit plans a meta model with
    32 MiB of parameters and a predicted peak of tens of MiB is Dynamo's and memfit's own
    bookkeeping (20 KiB measured: the saved RNG state, guards), under 1% of either."""
    with torch.device("meta"):
        model = MLP(depth=8, width=1024, d_in=1024, d_out=10)
    x = torch.empty(256, 1024, device="meta")
    plans: list[memfit.Plan] = []
    measured = memfit.measure(lambda: plans.append(memfit.plan(model, x, device="cpu")))
    assert measured.peak_bytes is not None
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert param_bytes >= 32 * 2**20
    assert measured.peak_bytes < 0.01 * min(param_bytes, plans[0].predicted_peak_bytes)
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.slow
def test_a_real_cpu_model_planned_for_cuda_is_left_untouched() -> None:
    """A device other than the model's is planned on fake tensors: the model's parameters and
    buffers (BatchNorm's statistics) are the same objects with the same values after."""
    c = case("resnet")
    model = c.make_model()
    args, kwargs = c.make_inputs()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tensors = [*model.parameters(), *model.buffers()]
    assert memfit.plan(model, *args, policy="none", device="cuda", **kwargs).predicted_peak_bytes
    assert [*model.parameters(), *model.buffers()] == tensors
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_bytes_planned_for_cuda_are_counted_in_its_allocators_blocks() -> None:
    """The MLP's ops have no scratch on either device; on CUDA each of its 16 x 10 logits
    (640 B) and every other storage takes whole 512-byte blocks."""
    c = case("mlp")
    args, kwargs = c.make_inputs()
    model = c.make_model()
    on_cuda = memfit.plan(model, *args, policy="none", device="cuda", **kwargs)
    torch.compiler.reset()
    on_cpu = memfit.plan(model, *args, policy="none", **kwargs)
    assert on_cuda.predicted_peak_bytes > on_cpu.predicted_peak_bytes
    assert on_cuda.predicted_peak_bytes % 512 == 0
    assert on_cuda.kept == on_cpu.kept


def test_a_meta_model_without_a_device_asks_for_one() -> None:
    model, args, kwargs = _meta_case("mlp")
    with pytest.raises(ValueError, match=r"device='cuda'"):
        memfit.plan(model, *args, **kwargs)


@pytest.mark.parametrize(
    "device, error, match",
    [
        ("tpu-v9", ValueError, "not a device torch knows nor a named one"),
        ("mps", ValueError, "memfit plans for cpu or cuda"),
        (3, TypeError, "a string or a torch.device"),
    ],
)
def test_a_device_memfit_cannot_plan_for_is_refused(device: Any, error: type, match: str) -> None:
    model, args, kwargs = _meta_case("mlp")
    with pytest.raises(error, match=match):
        memfit.plan(model, *args, device=device, **kwargs)


def test_a_named_gpu_is_planned_for_its_type() -> None:
    model, args, kwargs = _meta_case("mlp")
    by_type = memfit.plan(model, *args, device="cuda", **kwargs).predicted_peak_bytes
    by_name = memfit.plan(model, *args, device="H100-80GB", **kwargs).predicted_peak_bytes
    by_device = memfit.plan(model, *args, device=memfit.Device.named("l4"), **kwargs)
    assert by_name == by_type == by_device.predicted_peak_bytes


def test_what_needs_this_machines_measurements_is_refused_on_meta() -> None:
    model, args, kwargs = _meta_case("mlp")
    with pytest.raises(ValueError, match="executor='eager'"):
        memfit.plan(model, *args, executor="inductor", device="cpu", **kwargs)
    with pytest.raises(ValueError, match="offload_bandwidth"):
        memfit.plan(model, *args, offload=True, device="cpu", **kwargs)
    assert all(p.is_meta for p in model.parameters())


class _ReadsAValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x).tanh()
        return self.b(y * 2 if y.sum().item() > 0 else y)


def test_a_model_that_reads_a_value_says_it_cannot_be_planned_on_meta() -> None:
    with torch.device("meta"):
        model = _ReadsAValue()
    with pytest.raises(ValueError, match=r"reads a tensor's value .* plan the real model"):
        memfit.plan(model, torch.empty(8, 64, device="meta"), device="cpu")
    assert all(p.is_meta for p in model.parameters())


def test_what_is_meta() -> None:
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    x = torch.empty(2, 4, device="meta")
    assert is_meta(model) and is_meta(nn.Linear(4, 4), ((x,), {}))
    assert is_meta(nn.Linear(4, 4), ((), {"x": x}))
    assert not is_meta(nn.Linear(4, 4), ((torch.randn(2, 4),), {}))
