"""The loss-head pass finds ``cross_entropy(linear(h))`` however a model writes it, changes
nothing a user sees, and takes the logits out of what the step holds.

Loss and every parameter gradient equal plain PyTorch's under ``"none"``, ``"memory"``,
``"speed"`` and a budget, for a head written as ``F.cross_entropy(head(h), y)`` with ignored
tokens, as an older HuggingFace shift (``logits[..., :-1, :]``), as ``nll_loss(log_softmax)``
and in a tiny ``LlamaForCausalLM`` with labels (whose returned logits are unchanged); heads the
kernel cannot compute are left alone and reported; ``Options(loss_head="off")`` leaves every
head; and where the logits dominate (vocab 2048, hidden 64, 2048 tokens) the measured peak with
the rewrite is far below the one without, each within 10% of its prediction.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import memfit
from hf_models import tiny_hf
from memfit.capture import loss_head
from memfit.execution import backend

VOCAB, HIDDEN = 256, 32


class HeadModel(nn.Module):
    """Embedding, one tanh layer, a linear head and its loss, written as ``form`` says."""

    def __init__(self, form: str, vocab: int = VOCAB, hidden: int = HIDDEN) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.form, self.vocab = form, vocab
        self.embed = nn.Embedding(vocab, hidden)
        self.layer = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab, bias=form != "hf_shift")

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.layer(self.embed(x)))
        v = self.vocab
        if self.form == "cross_entropy":
            return F.cross_entropy(self.head(h).view(-1, v), y.view(-1))
        if self.form == "hf_shift":  # transformers 4's shift of the logits, summed
            logits = self.head(h).float()[..., :-1, :].contiguous()
            return F.cross_entropy(logits.view(-1, v), y[..., 1:].reshape(-1), reduction="sum")
        if self.form == "nll_loss":
            logp = F.log_softmax(self.head(h).flatten(0, 1), dim=-1)
            return F.nll_loss(logp, torch.where(y < 0, 3, y).flatten(), ignore_index=3)
        if self.form == "label_smoothing":
            return F.cross_entropy(self.head(h).view(-1, v), y.view(-1), label_smoothing=0.1)
        if self.form == "scaled_logits":
            return F.cross_entropy((self.head(h) * 2).view(-1, v), y.view(-1))
        raise ValueError(self.form)


@pytest.fixture(autouse=True)
def chunk_small_heads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The models here are tiny: their logits fit in one chunk, which the pass leaves alone in
    use (nothing to save); these tests rewrite them anyway, to check the rewrite itself, through
    the pass's own threshold, ``replace_loss_heads(min_chunks=1)``, as memfit's backend calls it."""
    rewrite_every_head = functools.partial(loss_head.replace_loss_heads, min_chunks=1)
    monkeypatch.setattr(backend, "replace_loss_heads", rewrite_every_head)


def test_a_head_whose_logits_fit_in_one_chunk_is_left_alone_and_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(backend, "replace_loss_heads", loss_head.replace_loss_heads)
    torch.manual_seed(0)
    head = nn.Linear(16, 4)  # a classifier: 8 tokens x 4 classes, far within one chunk

    @memfit.step(policy="none")
    def train_step(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(head(h), y)

    h, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    train_step(h, y).backward()
    (site,) = train_step.plan.loss_heads
    assert not site.fused and "within one chunk" in site.reason, site


def _dynamo_graph(fn: object, *args: torch.Tensor) -> torch.fx.GraphModule:
    """The one graph Dynamo captures of ``fn`` on ``args``, before AOTAutograd, as memfit's
    backend receives it."""
    graphs: list[torch.fx.GraphModule] = []

    def grab(gm: torch.fx.GraphModule, example_inputs: object) -> object:
        graphs.append(gm)
        return gm.forward

    torch.compiler.reset()
    torch.compile(fn, backend=grab, fullgraph=True)(*args)
    (gm,) = graphs
    return gm


@pytest.mark.parametrize(
    "tokens, min_chunks, fused, reason",
    [
        (8, 2, False, "within one chunk"),  # the default: 8 tokens, one chunk of 64
        (8, 1, True, "chunks"),
        (100, 2, True, "chunks"),  # 100 tokens of vocab 4096: two chunks of 64
        (100, 3, False, "within fewer than 3 chunks"),
    ],
)
def test_min_chunks_is_how_many_chunks_a_head_must_span_to_be_rewritten(
    tokens: int, min_chunks: int, fused: bool, reason: str
) -> None:
    torch.manual_seed(0)
    head = nn.Linear(16, 4096)  # a chunk: 1 MiB of fp32 logits, 64 tokens of vocab 4096
    h, y = torch.randn(tokens, 16), torch.randint(0, 4096, (tokens,))
    gm = _dynamo_graph(lambda h, y: F.cross_entropy(head(h), y), h, y)
    (site,) = loss_head.replace_loss_heads(gm, min_chunks=min_chunks)
    assert site.fused == fused and reason in site.reason, site


def _batch(vocab: int = VOCAB, shape: tuple[int, int] = (2, 24)) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, shape, generator=g)
    y = torch.randint(0, vocab, shape, generator=g)
    y[0, :5] = -100  # padding, ignored
    y[1, -3:] = 3  # ignored by the nll_loss form
    return x, y


def _step(model: nn.Module, *batch: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(*batch)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _assert_close(
    got: tuple[torch.Tensor, list[torch.Tensor]], ref: tuple[torch.Tensor, list[torch.Tensor]]
) -> None:
    (loss, grads), (ref_loss, ref_grads) = got, ref
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=0), (loss, ref_loss)
    for i, (g, r) in enumerate(zip(grads, ref_grads, strict=True)):
        err = (g - r).abs().max() / r.abs().max()
        assert err <= 1e-4, f"gradient {i}: relative error {err:.3g}"


#: Every form under "none" and "memory", the plain form under "speed" and a budget too; the fast
#: tier runs the plain form under "none" and "memory".
FORMS_AND_POLICIES = [
    pytest.param(form, policy, id=f"{form}-{policy}", marks=() if fast else pytest.mark.slow)
    for form, policy, fast in [
        ("cross_entropy", "none", True),
        ("cross_entropy", "memory", True),
        ("cross_entropy", "speed", False),
        ("cross_entropy", 0.6, False),
        ("hf_shift", "none", False),
        ("hf_shift", "memory", False),
        ("nll_loss", "none", False),
        ("nll_loss", "memory", False),
    ]
]


@pytest.mark.parametrize("form, policy", FORMS_AND_POLICIES)
def test_each_form_is_rewritten_and_matches_plain_pytorch(form: str, policy: object) -> None:
    model = HeadModel(form)
    batch = _batch()
    ref = _step(model, *batch)
    wrapped = memfit.checkpoint(copy.deepcopy(model), policy)
    _assert_close(_step(wrapped, *batch), ref)
    (site,) = wrapped.memfit.plan.loss_heads
    assert site.fused, site
    assert "test_loss_head.py:" in site.where
    rows = 2 * 23 if form == "hf_shift" else 2 * 24
    assert site.logits_shape == (rows, VOCAB)
    # kept for backward: h, the layer's input, a row copy of h (6 KiB each), targets, lse;
    # plain PyTorch keeps the 48 KiB log-probabilities besides
    logits_bytes = rows * VOCAB * 4
    assert wrapped.memfit.plan.kept_bytes < logits_bytes


@pytest.mark.slow
@pytest.mark.parametrize("form", ["label_smoothing", "scaled_logits"])
def test_heads_the_kernel_cannot_compute_are_left_alone_and_reported(form: str) -> None:
    model = HeadModel(form)
    batch = _batch()
    ref = _step(model, *batch)
    wrapped = memfit.checkpoint(copy.deepcopy(model), "memory")
    _assert_close(_step(wrapped, *batch), ref)
    (site,) = wrapped.memfit.plan.loss_heads
    assert not site.fused
    assert ("label smoothing" if form == "label_smoothing" else "mul") in site.reason
    assert "left alone" in str(site)


def test_loss_head_off_leaves_the_graph_as_written() -> None:
    model = HeadModel("cross_entropy")
    batch = _batch()
    ref = _step(model, *batch)
    options = memfit.Options(loss_head="off")
    wrapped = memfit.checkpoint(copy.deepcopy(model), "none", options=options)
    loss, grads = _step(wrapped, *batch)
    assert wrapped.memfit.plan.loss_heads == ()
    assert torch.equal(loss, ref[0])
    assert all(torch.equal(g, r) for g, r in zip(grads, ref[1], strict=True))


def test_options_loss_head_is_checked() -> None:
    assert memfit.Options(loss_head=memfit.LossHead.OFF).loss_head == "off"
    with pytest.raises(ValueError, match=r"loss_head must be one of \('auto', 'off'\)"):
        memfit.Options(loss_head="on")


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["none", "memory", 0.5], ids=str)
def test_llama_with_labels_matches_plain_pytorch(policy: object) -> None:
    """transformers' ForCausalLMLoss (labels padded and shifted, ``logits.float()``,
    ``ignore_index=-100``); the logits the model returns are the same tensor values."""
    model = tiny_hf("llama")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (2, 16), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100

    def step(m: nn.Module) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        m.zero_grad(set_to_none=True)
        out = m(input_ids=ids, labels=labels)
        out.loss.backward()
        return out.loss.detach(), out.logits.detach(), [p.grad.clone() for p in m.parameters()]

    ref_loss, ref_logits, ref_grads = step(model)
    wrapped = memfit.checkpoint(copy.deepcopy(model), policy)
    loss, logits, grads = step(wrapped)
    (site,) = wrapped.memfit.plan.loss_heads
    assert site.fused, site
    assert torch.allclose(logits, ref_logits, rtol=0, atol=1e-6)
    _assert_close((loss, grads), (ref_loss, ref_grads))


def _peaks(loss_head: str, policy: object) -> tuple[int, int]:
    """Predicted and measured peak of one step of a head whose logits dominate: vocab 2048,
    hidden 64, 2048 tokens (16 MiB of fp32 logits; the rest of the model, 2.5 MiB)."""
    vocab = 2048
    model = HeadModel("cross_entropy", vocab=vocab, hidden=64)
    x, y = _batch(vocab, (4, 512))
    options = memfit.Options(loss_head=loss_head)
    wrapped = memfit.checkpoint(model, policy, options=options)
    _step(wrapped, x, y)
    wrapped.zero_grad(set_to_none=True)  # the step measured makes its gradients anew

    def step() -> None:
        wrapped(x, y).backward()

    measured = memfit.measure(step).peak_bytes
    assert measured is not None
    return wrapped.memfit.plan.predicted_peak_bytes, measured


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["none", "memory"])
def test_the_rewrite_lowers_the_measured_peak_as_predicted(policy: str) -> None:
    predicted, measured = _peaks("auto", policy)
    off_predicted, off_measured = _peaks("off", policy)
    assert measured == pytest.approx(predicted, rel=0.1)
    assert off_measured == pytest.approx(off_predicted, rel=0.1)
    logits = 2048 * 2048 * 4
    assert off_measured >= 2 * logits  # plain: the logits and cross-entropy's copies of them
    assert measured <= off_measured // 8


@pytest.mark.slow
def test_a_rewritten_head_serves_every_sequence_length() -> None:
    """Lengths that vary are captured once more with the length as a symbol: the rows of h the
    kernel reads are reshaped with -1 where the logits' were, so the graph holds at each length."""
    model = HeadModel("hf_shift")
    plain = copy.deepcopy(model)
    wrapped = memfit.checkpoint(model, "memory")
    for length in (24, 40, 33, 17):
        batch = _batch(shape=(2, length))
        _assert_close(_step(wrapped, *batch), _step(plain, *batch))
        (site,) = wrapped.memfit.plan.loss_heads  # as captured: at 24, then at 40 for the rest
        rows = 2 * 23 if length == 24 else 2 * 39
        assert site.fused and site.logits_shape == (rows, VOCAB)
    assert wrapped.memfit._planned.shapes_planned == 2


class LossAndLogits(nn.Module):
    """Returns its loss and its logits, as HF models given labels do."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = HeadModel("cross_entropy", vocab=1024, hidden=64)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.inner
        logits = m.head(torch.tanh(m.layer(m.embed(x))))
        return F.cross_entropy(logits.flatten(0, 1), y.flatten()), logits


@pytest.mark.slow
@pytest.mark.parametrize("held", [False, True], ids=["dropped", "held"])
def test_returned_logits_are_computed_once_and_predicted(held: bool) -> None:
    """The logits a model returns come from its own linear, once in forward; whether the loop
    drops them before the backward or holds them through it, the step's peak is predicted (here
    60 KiB, 1.6%, above the measured 3.8 MB; the head as written is predicted to 4 bytes), and
    neither the logits nor anything of their size is kept for backward."""
    x, y = _batch(1024, (4, 128))
    plain = LossAndLogits()
    wrapped = memfit.checkpoint(copy.deepcopy(plain), "none")

    def step() -> None:
        loss, logits = wrapped(x, y)
        loss.backward()
        del logits

    def held_step() -> None:
        out = wrapped(x, y)
        out[0].backward()
        del out

    run = held_step if held else step
    for _ in range(3):  # a held start is believed on the second backward, planned on the third
        run()
        wrapped.zero_grad(set_to_none=True)
    measured = memfit.measure(run).peak_bytes
    assert measured is not None
    assert wrapped.memfit.plan.predicted_peak_bytes == pytest.approx(measured, rel=0.05)
    logits_bytes = 4 * 128 * 1024 * 4
    assert wrapped.memfit.plan.kept_bytes < logits_bytes // 4
    loss, logits = wrapped(x, y)
    ref_loss, ref_logits = plain(x, y)
    assert torch.equal(logits, ref_logits)
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=0)


def test_the_inductor_executor_runs_the_rewritten_head() -> None:
    """Inductor compiles around the kernel's custom ops (one extern call each way)."""
    model = HeadModel("hf_shift")
    batch = _batch()
    ref = _step(model, *batch)
    wrapped = memfit.checkpoint(copy.deepcopy(model), "memory", executor="inductor")
    _assert_close(_step(wrapped, *batch), ref)
    (site,) = wrapped.memfit.plan.loss_heads
    assert site.fused


@pytest.mark.slow
def test_a_head_under_autocast_is_left_alone() -> None:
    """Under autocast the linear's bf16 output is not its fp32 inputs' dtype: the kernel would
    compute another loss (in fp32), so the head stays as written, and the step as plain's."""
    model = HeadModel("cross_entropy")
    batch = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _step(model, *batch)
    wrapped = memfit.checkpoint(copy.deepcopy(model), "memory")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, grads = _step(wrapped, *batch)
    (site,) = wrapped.memfit.plan.loss_heads
    assert not site.fused and "autocast" in site.reason
    assert torch.equal(loss, ref[0])
    assert all(torch.equal(g, r) for g, r in zip(grads, ref[1], strict=True))
