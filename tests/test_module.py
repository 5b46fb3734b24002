"""memfit.checkpoint against plain PyTorch, the oracle, on every zoo model and every mode.

For each (model, mode): the loss and every parameter gradient of one step equal plain PyTorch's;
dropout draws the same masks (same loss under the same seed, and the global RNG ends in the same
state); BatchNorm running statistics are updated exactly once; 20 SGD steps give the same
parameters. memfit is applied in place: the model stays itself (class, signature, state dict), and
``memfit.remove`` takes it off again.

Where CUDA is available every (model, mode) runs there too, against plain PyTorch on the same
device (the CUDA generator's state checked as well), and the "memory" plan also compiled by
Inductor (``executor="inductor"``). On CUDA the comparison is one step's loss, gradients and
buffers, and the parameters after two steps, at fp32 tolerance (rtol 1e-4): cuDNN's kernels are
not deterministic, so plain PyTorch run twice on an H100 already differs (ResNet: gradients by
2e-8, parameters after 20 momentum steps by 7e-5), and memfit's graphs, whose BatchNorm and
convolution backward may pick other kernels than eager's, differed from plain by 1e-6 to 9e-6
in gradients, a difference that 20 steps grow to 2e-3 (measured 2026-11-25, H100, torch 2.13.0).
"""

from __future__ import annotations

import copy
import inspect
import io
import types
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn

import memfit
from conftest import CUDA
from memfit._compat import frames_converted
from memfit.bench.zoo import ZOO, ZooCase, tree_to
from memfit.planning.budget import Budget

RTOL, ATOL = 1e-5, 1e-6
#: Inductor's fused kernels reassociate sums: gradients agree to fp32 tolerance, not to the bit.
INDUCTOR_RTOL, INDUCTOR_ATOL = 1e-4, 1e-5
STEPS = 20
CUDA_STEPS = 2
CUDA_RTOL, CUDA_ATOL = INDUCTOR_RTOL, INDUCTOR_ATOL
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def _names_for(model: nn.Module) -> list[str]:
    """A few real submodule names to keep in the list mode: every other top-level child."""
    children = [name for name, _ in model.named_children()]
    return children[::2] or children


MODES: list[Any] = ["none", "memory", "speed", "collection", "names", "budget-min"]


def _run_steps(case: ZooCase, model: nn.Module, steps: int, device: str) -> dict[str, Any]:
    """Train ``steps`` SGD steps on ``device``, recording what the first step produced."""
    args, kwargs = tree_to(case.make_inputs(), device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    record: dict[str, Any] = {}
    torch.manual_seed(1234)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = case.loss(model(*args, **kwargs))
        loss.backward()
        if step == 0:
            record["loss"] = loss.detach().clone()
            record["grads"] = {
                n: p.grad.detach().clone()
                for n, p in model.named_parameters()
                if p.grad is not None
            }
            record["buffers"] = {n: b.detach().clone() for n, b in model.named_buffers()}
            record["rng"] = torch.get_rng_state()
            if device == "cuda":
                record["cuda_rng"] = torch.cuda.get_rng_state()
        opt.step()
    record["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return record


_reference_cache: dict[tuple[str, str], dict[str, Any]] = {}


def _reference(case: ZooCase, device: str) -> dict[str, Any]:
    key = (case.name, device)
    if key not in _reference_cache:
        _reference_cache[key] = _run_steps(
            case, case.make_model().to(device), _steps(device), device
        )
    return _reference_cache[key]


def _steps(device: str) -> int:
    return STEPS if device == "cpu" else CUDA_STEPS


def _close(
    a: torch.Tensor, b: torch.Tensor, what: str, rtol: float = RTOL, atol: float = ATOL
) -> None:
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def _wrap(case: ZooCase, model: nn.Module, mode: str, device: str, executor: str) -> nn.Module:
    if mode == "budget-min":  # the most aggressive budget plan: the smallest feasible peak
        args, kwargs = tree_to(case.make_inputs(), device)
        smallest = memfit.plan(model, *args, policy=1.0, **kwargs).pareto()[0].peak_bytes
        return memfit.checkpoint(model, smallest, executor=executor)
    policy = _names_for(model) if mode == "names" else mode
    return memfit.checkpoint(model, policy, executor=executor)


def _check_against(
    ref: dict[str, Any], got: dict[str, Any], rtol: float = RTOL, atol: float = ATOL
) -> None:
    _close(got["loss"], ref["loss"], "loss", rtol, atol)
    assert got["grads"].keys() == ref["grads"].keys()
    for name in ref["grads"]:
        _close(got["grads"][name], ref["grads"][name], f"grad of {name}", rtol, atol)
    for name in ref["buffers"]:  # BatchNorm running stats and num_batches_tracked: updated once
        _close(got["buffers"][name], ref["buffers"][name], f"buffer {name}", rtol, atol)
    assert torch.equal(got["rng"], ref["rng"]), "the global RNG stream diverged from plain PyTorch"
    if "cuda_rng" in ref:
        assert torch.equal(got["cuda_rng"], ref["cuda_rng"]), "the CUDA RNG stream diverged"
    for name in ref["params"]:
        what = f"parameter {name} after the last step"
        _close(got["params"][name], ref["params"][name], what, rtol, atol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ZOO, ids=[c.name for c in ZOO])
def test_matches_plain_pytorch(case: ZooCase, mode: str, device: str) -> None:
    ref = _reference(case, device)
    model = case.make_model().to(device)
    wrapped = _wrap(case, model, mode, device, "eager")
    got = _run_steps(case, wrapped, _steps(device), device)
    if device == "cpu":
        _check_against(ref, got)
    else:
        _check_against(ref, got, CUDA_RTOL, CUDA_ATOL)
    plan = wrapped.memfit.plan
    assert plan.predicted_peak_bytes <= plan.baseline_peak_bytes or mode in ("collection", "names")


@CUDA
@pytest.mark.parametrize("case", ZOO, ids=[c.name for c in ZOO])
def test_inductor_matches_plain_pytorch_on_cuda(case: ZooCase) -> None:
    ref = _reference(case, "cuda")
    model = case.make_model().to("cuda")
    got = _run_steps(case, _wrap(case, model, "memory", "cuda", "inductor"), CUDA_STEPS, "cuda")
    _check_against(ref, got, INDUCTOR_RTOL, INDUCTOR_ATOL)


class _Masked(nn.Module):
    """A model with a non-persistent buffer, a method of its own and a forward with keywords."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 256), nn.Linear(256, 4)
        self.register_buffer("mask", torch.ones(256), persistent=False)
        self.register_buffer("scale", torch.full((4,), 0.5))

    def forward(self, x: torch.Tensor, *, bias: float = 0.0) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)) * self.mask) * self.scale + bias

    def describe(self) -> str:
        return "masked"


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def test_applied_in_place_the_model_stays_itself() -> None:
    """What frameworks look at is the model's own: class, name, signature, attributes, state
    dict keys and buffer persistence (HF Trainer reads the signature; Lightning loads strictly)."""
    model = _Masked()
    keys, signature, text = list(model.state_dict()), inspect.signature(model.forward), repr(model)
    parameters = list(model.parameters())
    assert memfit.checkpoint(model, "memory") is model
    assert isinstance(model, _Masked) and isinstance(model, memfit.CheckpointedModule)
    assert type(model).__name__ == "_Masked" and type(model).__module__ == _Masked.__module__
    assert inspect.signature(model.forward) == signature
    assert model.forward.__name__ == "forward" and inspect.ismethod(model.forward)
    assert model.describe() == "masked" and repr(model) == text
    assert list(model.state_dict()) == keys and "mask" not in model.state_dict()
    assert list(model.parameters()) == parameters
    plain = _Masked()
    plain.load_state_dict(model.state_dict(), strict=True)
    model.load_state_dict(plain.state_dict(), strict=True)
    assert model.memfit.policy == memfit.Policy("memory")


def test_trains_as_plain_whether_called_or_its_forward_called() -> None:
    """``model(x)`` and ``model.forward(x)`` (as peft's LoraModel calls it) both run the plan."""
    model, plain = _Masked(), _Masked()
    plain.load_state_dict(model.state_dict())
    memfit.checkpoint(model, "memory")
    x = torch.randn(64, 16)
    for call in (model, model.forward):
        call(x, bias=1.0).sum().backward()
        plain(x, bias=1.0).sum().backward()
        _equal_lists(_grads(model), _grads(plain))
        assert model.memfit.plan.recomputed  # the plan ran: tanh's output recomputed


def _equal_lists(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_calls_without_autograd_run_plain_pytorch_and_hooks_run_once() -> None:
    model = _Masked()
    calls: list[int] = []
    model.register_forward_hook(lambda *args: calls.append(1))
    memfit.checkpoint(model, "memory")
    x = torch.randn(8, 16)
    with torch.no_grad():
        out = model(x)
    assert torch.equal(out, _Masked.forward(model, x))
    with pytest.raises(RuntimeError, match="called"):  # nothing captured or planned
        _ = model.memfit.plan
    model(x).sum().backward()
    assert len(calls) == 2  # the model's own hook ran once a call, outside memfit's graphs


def test_remove_restores_the_model() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    own = model.forward
    memfit.checkpoint(model, ["1"])  # a list policy registers a hook on "1"
    assert model[1]._forward_hooks
    model(torch.randn(3, 4)).sum().backward()
    assert memfit.remove(model) is model
    assert type(model) is nn.Sequential and "forward" not in model.__dict__
    assert not isinstance(model, memfit.CheckpointedModule) and not model[1]._forward_hooks
    assert model.forward == own
    with pytest.raises(TypeError, match="not applied"):
        memfit.remove(model)
    memfit.checkpoint(model, "speed")  # and it can be applied again
    assert model.memfit.policy == memfit.Policy("speed")


def test_applying_again_replaces_the_policy() -> None:
    """As a second ``model.compile()``: the new policy plans from the next call; memfit's class
    is not stacked on itself, and one ``remove`` restores the plain model."""
    model = memfit.checkpoint(_Masked(), "memory")
    model(torch.randn(4, 16)).sum().backward()
    forward = model.forward
    assert memfit.checkpoint(model, "speed") is model
    assert model.memfit.policy == memfit.Policy("speed")
    assert sum(c is memfit.CheckpointedModule for c in type(model).__mro__) == 1
    assert model.forward == forward  # the same forward, now running the new state
    with pytest.raises(RuntimeError, match="called"):  # the old plan is gone with its policy
        _ = model.memfit.plan
    model(torch.randn(4, 16)).sum().backward()
    assert model.memfit.plan.policy == "speed"
    memfit.remove(model)
    assert type(model) is _Masked and "forward" not in model.__dict__


def test_an_instance_forward_set_before_is_kept_and_put_back() -> None:
    """accelerate sets ``model.forward`` on the instance (its autocast wrapper): memfit runs that
    forward, keeps it a bound method, and ``remove`` puts the same object back."""
    model = _Masked()
    seen: list[bool] = []

    def wrapper(self: nn.Module, x: torch.Tensor, *, bias: float = 0.0) -> torch.Tensor:
        seen.append(torch.is_grad_enabled())
        return _Masked.forward(self, x, bias=bias)

    own = types.MethodType(wrapper, model)
    model.forward = own  # type: ignore[method-assign]
    memfit.checkpoint(model, "memory")
    assert model.forward is not own and inspect.signature(model.forward) == inspect.signature(own)
    model(torch.randn(4, 16)).sum().backward()
    with torch.no_grad():
        model(torch.randn(4, 16))
    assert seen[-1] is False and len(seen) >= 2
    memfit.remove(model)
    assert model.__dict__["forward"] is own


def test_deepcopy_and_pickling_apply_memfit_to_the_copy() -> None:
    model = memfit.checkpoint(_Masked(), "speed")
    x = torch.randn(64, 16)
    model(x).sum().backward()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for copied in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        assert isinstance(copied, _Masked) and isinstance(copied, memfit.CheckpointedModule)
        assert copied.memfit.policy == model.memfit.policy
        assert all(a is not b for a, b in zip(copied.parameters(), model.parameters()))
        assert list(copied.state_dict()) == list(model.state_dict())
        copied.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        copied(x).sum().backward()
        model(x).sum().backward()
        _equal_lists(_grads(copied), _grads(model))
        assert copied.memfit.plan.graphs  # the copy planned on its own first call


def test_same_outputs_and_eval_mode() -> None:
    case = next(c for c in ZOO if c.name == "structured")
    model = case.make_model()
    args, kwargs = case.make_inputs()
    expected = model(*args, **kwargs)
    got = memfit.checkpoint(copy.deepcopy(model))(*args, **kwargs)
    assert expected.keys() == got.keys()
    _close(got["logits"], expected["logits"], "logits")
    for a, b in zip(got["aux"], expected["aux"]):
        _close(a, b, "aux")
    model.eval()
    wrapped = memfit.checkpoint(copy.deepcopy(model))
    with torch.no_grad():
        _close(wrapped(*args, **kwargs)["logits"], model(*args, **kwargs)["logits"], "eval logits")


def test_recaptures_on_new_shape_and_dtype() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    model = memfit.checkpoint(copy.deepcopy(plain), "memory")
    for shape, dtype in [((4, 8), torch.float32), ((9, 8), torch.float32), ((4, 8), torch.float64)]:
        model.to(dtype)
        plain.to(dtype)
        x = torch.randn(*shape, dtype=dtype)
        model(x).sum().backward()
        plain(x).sum().backward()
        for g, p in zip(_grads(model), plain.parameters()):
            torch.testing.assert_close(g, p.grad)
        model.zero_grad()
        plain.zero_grad()
        assert model.memfit.plan.graphs[0].num_nodes > 0


def test_plan_before_first_call_explains() -> None:
    wrapped = memfit.checkpoint(nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="called"):
        _ = wrapped.memfit.plan


def test_plan_prints_summary() -> None:
    case = ZOO[0]
    wrapped = memfit.checkpoint(case.make_model(), "memory")
    args, kwargs = case.make_inputs()
    case.loss(wrapped(*args, **kwargs)).backward()
    text = str(wrapped.memfit.plan)
    assert "predicted peak" in text and "recomputed" in text and "'memory'" in text


@pytest.mark.parametrize(
    "bad, error, words",
    [
        ("fast", ValueError, ["'fast'", "'memory'", "'speed'"]),
        ("memroy", ValueError, ["did you mean 'memory'"]),
        (None, TypeError, ["NoneType"]),
        (True, TypeError, ["True"]),
        (0, ValueError, ["positive"]),
        ("budget=0.5", ValueError, ["'0.5'", "removed"]),
        (["0", 5], TypeError, ["5"]),
        (["layers.0"], ValueError, ["'layers.0'", "closest"]),
    ],
)
def test_invalid_policy_argument(bad: Any, error: type, words: list[str]) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    with pytest.raises(error) as info:
        memfit.checkpoint(model, bad)
    for w in words:
        assert w in str(info.value)


def test_not_a_module() -> None:
    with pytest.raises(TypeError, match="nn.Module"):
        memfit.checkpoint(lambda x: x)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "removed",
    [
        {"budget": 0.5},
        {"checkpoints": "speed"},
        {"attention": "off"},
        {"offload_to": "disk"},
        {"offload_dir": "/tmp"},
        {"autotune": True},
        {"max_shapes": 2},
        {"measure_outside": False},
    ],
)
def test_removed_keywords_are_refused(removed: dict[str, Any]) -> None:
    """0.2 has one spelling of each: the budget is the policy, the knobs are in Options."""
    with pytest.raises(TypeError, match=next(iter(removed))):
        memfit.checkpoint(nn.Linear(2, 2), **removed)


def test_a_budget_is_bytes_a_size_or_a_fraction() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    assert memfit.checkpoint(model, 0.5).memfit.policy.budget == Budget(fraction=0.5)
    assert memfit.checkpoint(model, "0.5").memfit.policy.budget == Budget(fraction=0.5)
    assert memfit.checkpoint(model, "2MiB").memfit.policy.budget == Budget(bytes=2 * 2**20)
    assert memfit.checkpoint(model, 4096).memfit.policy.budget == Budget(bytes=4096)
    with pytest.raises(ValueError, match="fraction"):
        memfit.checkpoint(nn.Linear(2, 2), 1.5)
    with pytest.raises(ValueError, match="cannot parse"):
        memfit.checkpoint(nn.Linear(2, 2), "2lots")


def test_offload_is_a_switch_and_its_settings_are_options() -> None:
    with pytest.raises(TypeError, match="Options"):
        memfit.checkpoint(nn.Linear(2, 2), "memory", offload="disk")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="memfit.Options"):
        memfit.checkpoint(nn.Linear(2, 2), options={"attention": "off"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'eager', 'inductor'"):
        memfit.checkpoint(nn.Linear(2, 2), executor="fast")
    assert memfit.Options(attention="off").attention is memfit.Attention.OFF
    assert memfit.Executor("inductor") == "inductor"


def test_plan_leaves_model_and_rng_untouched() -> None:
    """memfit.plan runs a forward but restores buffers and RNG, and computes no gradient."""
    case = next(c for c in ZOO if c.has_batchnorm)
    model = case.make_model()
    args, kwargs = case.make_inputs()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    plan = memfit.plan(model, *args, policy=0.9, **kwargs)
    assert torch.equal(torch.get_rng_state(), rng)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in model.parameters())
    assert plan.policy == "budget" and plan.predicted_peak_bytes <= plan.budget_bytes


@pytest.mark.slow
def test_fraction_and_equivalent_bytes_give_the_same_plan() -> None:
    case = next(c for c in ZOO if c.name == "resnet")
    args, kwargs = case.make_inputs()
    by_fraction = memfit.plan(case.make_model(), *args, policy=0.85, **kwargs)
    torch.compiler.reset()
    # A fraction is of the activations plain autograd keeps; the rest of the step is added.
    base = by_fraction.baseline_peak_bytes
    assert by_fraction.budget_bytes is not None
    assert by_fraction.budget_bytes >= base - round(0.15 * by_fraction.baseline_kept_bytes)
    in_bytes = by_fraction.budget_bytes
    assert 0.85 * base < in_bytes < base
    by_bytes = memfit.plan(case.make_model(), *args, policy=in_bytes, **kwargs)
    assert by_bytes.budget_bytes == by_fraction.budget_bytes == in_bytes
    assert by_fraction.recompute_flops > 0  # a real trade-off, not plain autograd
    assert by_bytes.kept == by_fraction.kept and by_bytes.recomputed == by_fraction.recomputed
    assert by_bytes.predicted_peak_bytes == by_fraction.predicted_peak_bytes


@pytest.mark.slow
def test_infeasible_budget_raises_with_the_smallest() -> None:
    case = next(c for c in ZOO if c.name == "resnet")
    args, kwargs = case.make_inputs()
    model = case.make_model()
    smallest = memfit.plan(model, *args, policy=1.0, **kwargs).pareto()[0].peak_bytes
    torch.compiler.reset()
    wrapped = memfit.checkpoint(model, smallest - 1)
    with pytest.raises(memfit.BudgetError) as info:
        wrapped(*args, **kwargs)
    assert info.value.least_bytes == smallest
    assert f"{smallest} bytes" in str(info.value)


def test_torch_compile_around_the_wrapper_still_plans_and_saves() -> None:
    """``torch.compile(memfit.checkpoint(m))``: the outer compile steps around memfit's forward
    and its call (it would otherwise trace through it and run the model unplanned, keeping
    everything, or convert memfit's bookkeeping into graphs of its own)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.Tanh()) for _ in range(6)])
    x = torch.randn(256, 128)
    plain = memfit.measure(lambda: model(x).sum().backward())
    expected = [p.grad.clone() for p in model.parameters()]
    wrapped = memfit.checkpoint(model, "memory")
    outer = torch.compile(wrapped)
    for p in model.parameters():
        p.grad = None
    outer(x).sum().backward()  # first call: capture and plan
    outer(x).sum().backward()  # the output is gone before the backward, twice: planned again
    outer(x).sum().backward()
    for p in model.parameters():
        p.grad = None
    frames, converted = frames_converted()
    step = memfit.measure(lambda: outer(x).sum().backward())
    # Steady state: Dynamo converted no frame, memfit's Python included (the outer compile once
    # converted its bookkeeping frame by frame, holding the model's output into the backward).
    assert frames_converted() == (frames, converted)
    assert wrapped.memfit.plan.recomputed  # memfit planned the step
    assert (step.peak_bytes or 0) < 0.9 * (plain.peak_bytes or 0)
    for p, g in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)


def test_a_wrapper_inside_another_is_captured_and_planned_as_part_of_it() -> None:
    """A memfit wrapper inside a model that is itself wrapped (here in an nn.Sequential, whose
    loop Dynamo cannot resume inside): the outer capture traces through the inner wrapper, so the
    whole model is one graph under the outer plan. Stepping around the inner one made Dynamo
    give up on the loop's frame, and the outer model ran unplanned, as plain PyTorch."""

    def build() -> tuple[nn.Module, nn.Module]:
        torch.manual_seed(0)
        inner = nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.Tanh()) for _ in range(3)])
        outer = [nn.Sequential(nn.Linear(128, 128), nn.Tanh()) for _ in range(3)]
        return inner, nn.Sequential(*outer[:2], inner, outer[2])

    x = torch.randn(256, 128)
    _, plain = build()
    plain_peak = memfit.measure(lambda: plain(x).sum().backward()).peak_bytes or 0
    inner, model = build()
    model[2] = memfit.checkpoint(inner, "none")
    wrapped = memfit.checkpoint(model, "memory")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped(x).sum().backward()
        for p in model.parameters():
            p.grad = None
        peak = memfit.measure(lambda: wrapped(x).sum().backward()).peak_bytes or 0
    said = [str(w.message) for w in caught]
    assert not [m for m in said if "plain PyTorch" in m or "could not capture" in m], said
    assert len(wrapped.memfit.plan.graphs) == 1 and wrapped.memfit.plan.recomputed
    assert peak < 0.9 * plain_peak
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_a_model_setting_problem_type_on_its_first_call_is_captured_once() -> None:
    """HuggingFace heads set ``config.problem_type`` on their first call with labels; Dynamo
    guarded the capture on its old value and captured and planned the model again on the
    second call. memfit lets the first call's attribute changes happen before it captures."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=100,
        max_position_embeddings=64,
        num_labels=3,
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    plain = copy.deepcopy(model)
    ids = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 2, 1, 0])
    wrapped = memfit.checkpoint(model, "memory")
    plans = []
    for _ in range(3):
        torch.manual_seed(5)  # dropout
        wrapped(input_ids=ids, labels=labels).loss.backward()
        torch.manual_seed(5)
        plain(input_ids=ids, labels=labels).loss.backward()
        plans.append(wrapped.memfit.plan)
    assert model.config.problem_type == plain.config.problem_type == "single_label_classification"
    assert plans[1] is plans[0] and plans[2] is plans[0]  # no second capture, no second plan
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_remove_refuses_when_the_class_was_changed_on_top_of_memfits() -> None:
    """FSDP2's ``fully_shard`` swaps the class again; putting the model's own class back would
    drop that one's, so ``remove`` says so instead."""
    model = memfit.checkpoint(_Masked(), "memory")
    model.__class__ = type("Sharded_Masked", (type(model),), {})
    with pytest.raises(TypeError, match="class was changed after memfit"):
        memfit.remove(model)
    assert isinstance(model, memfit.CheckpointedModule) and model.memfit.policy.name == "memory"


def test_following_wrapped_from_forward_does_not_step_around_memfit() -> None:
    """accelerate's ``unwrap_model(keep_fp32_wrapper=False)`` follows ``__wrapped__`` from
    ``model.forward`` and installs the innermost function: memfit's forward ends that walk."""
    model = memfit.checkpoint(_Masked(), "memory")
    assert not hasattr(model.forward, "__wrapped__")
    assert inspect.signature(model.forward) == inspect.signature(_Masked().forward)


def test_remove_refuses_when_forward_was_replaced_on_top_and_applying_again_still_works() -> None:
    model = memfit.checkpoint(_Masked(), "memory")
    ours = model.forward
    model.forward = types.MethodType(  # type: ignore[method-assign]
        lambda self, *args, **kwargs: ours(*args, **kwargs), model
    )
    with pytest.raises(TypeError, match="forward was replaced after memfit"):
        memfit.remove(model)
    memfit.checkpoint(model, "speed")  # a new state behind the same forwards
    model(torch.randn(64, 16)).sum().backward()
    assert model.memfit.plan.policy == "speed"


class _HookedOnItself(_Masked):
    """A model whose own method is one of its hooks: a reference back to the model."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.register_forward_pre_hook(self._count)

    def _count(self, module: nn.Module, args: Any) -> None:
        self.calls += 1


def test_a_copy_refers_to_itself_where_the_model_referred_to_itself() -> None:
    model = memfit.checkpoint(_HookedOnItself(), ["a"])
    copied = copy.deepcopy(model)
    (hook,) = copied._forward_pre_hooks.values()
    assert hook.__self__ is copied
    copied(torch.randn(4, 16))
    assert copied.calls == 1 and model.calls == 0
    assert len(copied.a._forward_hooks) == 1  # memfit's mark hook, once


def test_a_module_made_from_memfits_class_can_have_memfit_applied() -> None:
    """Slicing an ``nn.Sequential`` makes a new instance of the model's class, here memfit's."""
    model = memfit.checkpoint(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)))
    head = model[:-1]
    assert isinstance(head, memfit.CheckpointedModule) and not hasattr(head, "memfit")
    memfit.checkpoint(head, "memory")
    head(torch.randn(3, 4)).sum().backward()
    assert head.memfit.plan.graphs
    memfit.remove(head)
    assert type(head) is nn.Sequential
