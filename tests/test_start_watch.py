"""memfit sees, at a graph's first backward, which outputs the loop held and which got a
gradient, and its prediction is the step's (``execution.start_watch``,
``analysis.backward_start``). On CPU memory is counted exactly, so the prediction is compared
with the measured step to a few bytes: before, a model returning its loss and logits was
predicted above its step by the logits twice over (kept to the end of the backward, and their
gradient counted), whichever loop ran it."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import memfit
from memfit.execution.start_watch import StartWatch

#: what a step allocates beyond the graphs memfit predicts (the loss's gradient of one element,
#: the engine's small buffers): bytes
SLACK = 64

#: LossLM's head as written: its cross-entropy keeps and builds logits-sized values in the
#: backward, which is what makes held logits matter here (with the loss-head kernel they add
#: nothing to the backward's peak: tests/test_loss_head.py)
AS_WRITTEN = memfit.Options(loss_head="off")


class LossLM(nn.Module):
    """A causal-LM shape: returns its loss and its logits, as Hugging Face models given
    ``labels`` do."""

    def __init__(self, vocab: int = 512, width: int = 64, depth: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.embed(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        logits = self.head(h)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten()), logits


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 512, (8, 32), generator=g), torch.randint(0, 512, (8, 32), generator=g)


def _measured(model: nn.Module, step: object) -> int:
    for p in model.parameters():
        p.grad = None
    return memfit.measure(step).peak_bytes  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", ["none", "memory"])
def test_logits_the_loop_drops_are_predicted_gone(policy: str) -> None:
    """``model(x, y)[0].backward()``, as ``Trainer`` runs it: the logits are gone before the
    backward and get no gradient, as memfit assumes of a model returning a scalar loss."""
    x, y = _batch()
    model = memfit.checkpoint(LossLM(), policy, options=AS_WRITTEN)

    def step() -> None:
        model(x, y)[0].backward()

    step()
    assert not model.memfit.replan_pending  # the start seen is the one assumed
    measured = _measured(model, step)
    assert abs(model.memfit.plan.predicted_peak_bytes - measured) <= SLACK


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["none", "memory"])
def test_logits_held_through_the_backward_are_planned_again(policy: str) -> None:
    """``loss, logits = model(x, y)``: the logits live through the backward, which the plan
    assumed they would not; memfit plans again, and the step's peak is then predicted."""
    x, y = _batch()
    model = memfit.checkpoint(LossLM(), policy, options=AS_WRITTEN)

    def step() -> None:
        loss, logits = model(x, y)
        loss.backward()
        del logits

    step()
    assumed = model.memfit.plan.predicted_peak_bytes
    assert not model.memfit.replan_pending  # believed once a second backward shows it too
    step()
    assert model.memfit.replan_pending
    step()
    assert not model.memfit.replan_pending
    measured = _measured(model, step)
    assert abs(model.memfit.plan.predicted_peak_bytes - measured) <= SLACK
    assert model.memfit.plan.predicted_peak_bytes > assumed
    note = model.memfit.plan.graphs[0].note
    assert "planned for how earlier steps used the outputs" in note
    assert "given no gradient" in note, note


def test_an_output_dropped_with_the_loss_computed_outside_is_planned_again() -> None:
    """No loss inside: the output is assumed held and given a gradient. A loop computing the
    loss from a temporary (``F.cross_entropy(model(x), y)``) frees the logits before the
    backward: planned again once, then predicted."""
    x, y = _batch()
    inner = LossLM()
    head = nn.Sequential(inner.embed, nn.Tanh(), inner.head)
    model = memfit.checkpoint(head, "none")

    def step() -> None:
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()

    step()
    step()
    assert model.memfit.replan_pending
    step()
    assert not model.memfit.replan_pending
    with pytest.warns(UserWarning, match="outside memfit's graphs"):
        _measured(model, step)  # on CPU the loss's bytes are measured inside memfit.measure
    step()  # planned again with them reserved
    measured = _measured(model, step)
    assert abs(model.memfit.plan.predicted_peak_bytes - measured) <= SLACK


@pytest.mark.slow
def test_gradients_stay_plain_pytorchs_under_either_loop() -> None:
    x, y = _batch()
    reference = LossLM()
    reference(x, y)[0].backward()
    for held in (False, True):
        model = memfit.checkpoint(LossLM(), "memory", options=AS_WRITTEN)
        for _ in range(3):  # the third step runs the plan made again
            model.zero_grad(set_to_none=True)
            out = model(x, y)
            out[0].backward()
            if held:
                del out
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_a_small_difference_is_noted_without_planning_again() -> None:
    """An output that differs from the plan's assumption by little (under 1% of the peak)
    is remembered, not worth a new capture; a start unlike the plan's is believed when two
    backwards in a row show it."""
    from memfit.analysis.graph import BackwardStart

    graph = fx.Graph()
    x = graph.placeholder("x")
    outs = [graph.create_node("call_function", torch.neg, (x,), name=n) for n in ("big", "small")]
    graph.output(tuple(outs))
    forward = fx.GraphModule(nn.Module(), graph)
    planned = BackwardStart(dropped=frozenset({"big", "small"}))

    def seen_when(held: str) -> tuple[BackwardStart, bool]:
        seen: list[tuple[BackwardStart, bool]] = []
        watch = StartWatch(planned, {"big": 1000, "small": 5}, 1000, lambda *a: seen.append(a))
        watch.forward_graph(forward, user_outputs=2)
        for _ in range(2):  # believed when two backwards in a row show it
            assert watch.pending and not seen
            ctx = type("Ctx", (), {})()
            values = {"big": torch.zeros(250), "small": torch.zeros(1)}
            watch.note_forward(ctx, [values["big"], values["small"]])
            kept = values.pop(held)  # noqa: F841 - the caller holds it through the backward
            values.clear()
            watch.note_backward(ctx, frozenset())
        assert not watch.pending
        (report,) = seen
        return report

    start, material = seen_when("big")
    assert start.dropped == frozenset({"small"}) and material  # 100% of the peak held
    start, material = seen_when("small")
    assert start.dropped == frozenset({"big"}) and not material  # 0.5% held
