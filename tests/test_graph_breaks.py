"""A model Dynamo cannot capture as one graph still trains exactly, saves memory in each piece,
and tells the user once where the graph broke."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.nn as nn

import memfit
from memfit._compat import graph_break_reasons
from memfit.capture import graph_breaks
from memfit.capture.graph_breaks import GraphBreakWatcher


class Branchy(nn.Module):
    """Two deep tanh stacks separated by a Python `if` on a tensor value (a graph break)."""

    def __init__(self, depth: int = 24, width: int = 256) -> None:
        super().__init__()
        self.first = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.second = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.first:
            x = torch.tanh(layer(x))
        if x.sum() > 0:  # data-dependent control flow
            x = x * 2
        for layer in self.second:
            x = torch.tanh(layer(x))
        return x


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_graph_break_trains_exactly_and_warns_once_with_location() -> None:
    torch.manual_seed(0)
    model = Branchy()
    x = torch.randn(512, 256)
    expected = _grads(model, x)
    wrapped = memfit.checkpoint(model, "memory")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _grads(wrapped, x)
        _grads(wrapped, x)
        _grads(wrapped, x)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    ours = [w for w in caught if "memfit could not capture" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    message = str(ours[0].message)
    assert "Branchy" in message and "test_graph_breaks.py" in message
    assert ours[0].filename == __file__  # attributed to the calling line, not to torch
    assert "Data-dependent branching" in message and "torch.where" in message  # the cause
    assert len(wrapped.memfit.plan.graphs) >= 2


@pytest.mark.slow
def test_graph_break_still_saves_memory() -> None:
    torch.manual_seed(0)
    x = torch.randn(2048, 256)  # activations well above the 12 MB of weight gradients

    def peak(mode: str) -> int:
        torch.compiler.reset()
        torch.manual_seed(0)
        wrapped = memfit.checkpoint(Branchy(), mode)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _grads(wrapped, x)
            result = memfit.measure(lambda: wrapped(x).square().mean().backward())
        assert result.peak_bytes is not None
        return result.peak_bytes

    assert peak("memory") < 0.6 * peak("none")


def _breaks(x: torch.Tensor) -> torch.Tensor:
    x = x + 1
    if x.sum() > 0:  # data-dependent control flow: a graph break
        x = x * 2
    return x - 1


def test_watcher_reports_each_conversions_breaks_and_reads_reasons_only_after_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The watcher reads Dynamo's reasons only when a frame was converted, yet finds every new
    break, after Dynamo's counters are cleared too (the same reason then counts from 1 again, not
    above the count last read)."""
    watcher = GraphBreakWatcher("fn")
    reads = []

    def counted() -> dict[str, int]:
        reads.append(1)
        return graph_break_reasons()

    monkeypatch.setattr(graph_breaks, "graph_break_reasons", counted)
    for _ in range(2):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        compiled = torch.compile(_breaks, backend="eager")
        with watcher.watch() as report:
            compiled(torch.ones(3))
        assert report.broke
        with watcher.watch() as report:  # served from Dynamo's cache: no frame converted
            reads.clear()
            compiled(torch.ones(3))
        assert not report.broke
        assert not reads


_LOG = logging.getLogger(__name__)


class Chatty(nn.Module):
    """Two Linear-tanh stacks with a logger call and a ``warnings.warn`` between them."""

    def __init__(self, depth: int = 4, width: int = 64) -> None:
        super().__init__()
        self.first = nn.Sequential(
            *(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))
        )
        self.second = nn.Sequential(
            *(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        _LOG.warning("chatty: halfway through, width %d", x.shape[-1])
        warnings.warn("chatty: a user's warning", stacklevel=2)
        return self.second(x)


def _user_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("chatty")]


def _memfit_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "memfit could not capture" in str(w.message)]


def _chatty() -> tuple[Chatty, torch.Tensor, list[torch.Tensor]]:
    """The logging model, a batch, and plain PyTorch's gradients (its warnings silenced)."""
    torch.manual_seed(0)
    model = Chatty()
    x = torch.randn(32, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = _grads(model, x)
    return model, x, expected


def test_logging_and_warnings_in_a_forward_do_not_break_the_graph() -> None:
    """A logger call and ``warnings.warn`` in a forward leave a step one graph, with plain
    PyTorch's gradients, and a ``warnings.warn`` in the step function itself still fires on every
    step (Dynamo replays it after the graph). The others are dropped inside a compiled step:
    Dynamo 2.13 replays only calls in the frame it compiles, not in the model's forward it inlines
    into it, and it can only drop a ``logging.Logger`` method call, never replay it (NOTE
    [logging without graph breaks] in ``memfit._compat``)."""
    model, x, expected = _chatty()

    def loss(x: torch.Tensor) -> torch.Tensor:
        warnings.warn("chatty: the step's own warning", stacklevel=2)
        return model(x).square().mean()

    step = memfit.step(loss, policy="memory")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            step(x).backward()
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, e, rtol=1e-5, atol=1e-6)
    assert len(step.plan.graphs) == 1
    assert not _memfit_warnings(caught), _memfit_warnings(caught)
    assert _user_warnings(caught).count("chatty: the step's own warning") == 2


def test_a_checkpointed_model_that_logs_trains_exactly_without_a_break_warning() -> None:
    """The forward memfit compiles is the frame Dynamo replays ``warnings.warn`` in: the user's
    warning fires as in plain PyTorch."""
    model, x, expected = _chatty()
    wrapped = memfit.checkpoint(model, "memory")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _grads(wrapped, x)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    assert not _memfit_warnings(caught), _memfit_warnings(caught)
    assert _user_warnings(caught) == ["chatty: a user's warning"]


def test_huggingface_warning_once_does_not_break_the_graph() -> None:
    """transformers' ``logger.warning_once`` (a ``functools.lru_cache`` set on
    ``logging.Logger``), as HF GPT-2's loss calls it each step, leaves a step one graph. Like
    any logger call in a compiled forward it is dropped, not replayed (see above)."""
    hf_logging = pytest.importorskip("transformers.utils.logging")
    logger = hf_logging.get_logger("memfit.tests.graph_breaks")

    def loss(x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(x @ x.T)
        logger.warning_once("memfit test: a once-only warning")
        logger.info_once("memfit test: a once-only note")
        return torch.tanh(y @ x).square().mean()

    x = torch.randn(16, 16, requires_grad=True)
    expected = torch.autograd.grad(loss(x), x)[0]
    step = memfit.step(loss, policy="memory")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = torch.autograd.grad(step(x), x)[0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert len(step.plan.graphs) == 1
    assert not _memfit_warnings(caught), _memfit_warnings(caught)


class Scalar(nn.Module):
    """A ``.item()`` mid-forward: a break that is not control flow on a tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.a(x))
        scale = x.abs().max().item()
        return self.b(x / scale)


def test_break_warning_names_dynamos_reason_and_suggests_torch_where_only_for_branching() -> None:
    model = memfit.checkpoint(Scalar(), "memory")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(8, 16)).sum().backward()
    (message,) = _memfit_warnings(caught)
    assert "Tensor.item()" in message and "capture_scalar_outputs" in message, message
    assert "torch.where" not in message and "torch.cond" not in message, message


def test_is_data_dependent_and_summarize_reason_read_dynamos_reasons() -> None:
    branching = (
        "Data-dependent branching\n"
        "  Explanation: Detected data-dependent branching (e.g. `if my_tensor.sum() > 0:`). "
        "Dynamo does not support tracing dynamic control flow.\n\n"
        "      The branch condition involves a tensor computed as follows:\n"
        '        # File "/m/model.py", line 27, in forward, code: if x.sum() > 0:\n'
        "  Hint: Use `torch.cond` to express dynamic control flow.\n"
    )
    builtin = (
        "Failed to trace builtin operator\n"
        "  Explanation: Dynamo does not know how to trace builtin operator `print` with "
        "argument types ['str'] (has_kwargs False)\n"
        "  Hint: Avoid calling builtin `print` with argument types ['str'].\n"
    )
    assert graph_breaks.is_data_dependent(branching)
    assert graph_breaks.is_data_dependent("generic_jump TensorVariable()")
    assert not graph_breaks.is_data_dependent(builtin)
    assert (
        graph_breaks.summarize_reason(branching)
        == "Data-dependent branching at /m/model.py:27 in forward"
    )
    assert graph_breaks.summarize_reason(builtin) == (
        "Failed to trace builtin operator: Dynamo does not know how to trace builtin operator "
        "`print` with argument types ['str'] (has_kwargs False)"
    )
    assert graph_breaks.summarize_reason("") == "unknown reason"


class LoopBranch(nn.Module):
    """A data-dependent `if` inside the forward's own loop: Dynamo 2.13 skips the whole frame."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
            x = torch.relu(x) if x.mean() > 0 else torch.tanh(x)
        return x


def test_a_break_in_a_loop_says_the_frame_ran_unplanned_once_and_trains_exactly() -> None:
    torch.manual_seed(0)
    model, x = LoopBranch(), torch.randn(8, 16)
    plain = _grads(model, x)
    memfit.checkpoint(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = [_grads(model, x) for _ in range(2)]
    said = [
        str(w.message)
        for w in caught
        if "memfit" in str(w.message) or "LoopBranch" in str(w.message)
    ]
    assert len(said) == 1, said  # one warning: the break, and that nothing was planned
    assert "skip the whole frame" in said[0] and "test_graph_breaks.py" in said[0], said[0]
    assert "torch.where" in said[0]
    for step in ours:
        for a, b in zip(step, plain):
            assert torch.equal(a, b)
    assert graph_breaks.skips_frame(
        "graph break in loop\n  Explanation: torch.compile detected a graph break in a for/while "
        "loop. Skipping the frame and falling back to eager, as graph breaks in loops are not "
        "supported."
    )
    assert not graph_breaks.skips_frame("Data-dependent branching\n  Explanation: ...")
