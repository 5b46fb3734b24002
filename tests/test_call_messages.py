"""execution.call_messages: what a wrapper's warnings say, checked where the text decides."""

from __future__ import annotations

import warnings

import torch

import memfit
from memfit.execution.call_messages import CallWarnings, Once, break_action, swap_saved_little
from memfit.planning.policy import Policy


def test_the_break_warning_says_what_memfit_does_about_the_breaks() -> None:
    assert break_action(None, Policy("none"), chained=False) is None  # the default: kept
    said = break_action(None, Policy("memory"), chained=True)
    assert said is not None and "chain" in said and said[0].isupper()


def test_a_model_broken_in_its_own_python_is_told_its_graphs_run_as_a_chain() -> None:
    def block(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        x = layer(x)
        return torch.tanh(x) if x.mean() > 0 else torch.sigmoid(x)

    class Broken(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = block(layer, x)
            return x

    model = memfit.checkpoint(Broken())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(4, 8)).sum().backward()
    said = [str(w.message) for w in caught if "graph break" in str(w.message)]
    assert said and "one chain" in said[0]


def test_swap_names_the_model_and_what_to_do_instead() -> None:
    said = swap_saved_little("Net", 0, 1000)
    assert said is not None and "Net" in said and "offloaded nothing" in said
    assert "offload=True" in said


def test_swap_that_saves_little_says_how_little_and_one_that_saves_enough_says_nothing() -> None:
    # the MobileNet-like net on CPU: 1 MiB offloaded of the 313 MiB kept
    said = swap_saved_little("Net", 2**20, 312 * 2**20)
    assert said is not None and "offloaded only 1.00 MiB of the 313.00 MiB" in said, said
    assert swap_saved_little("Net", 50, 50) is None
    assert swap_saved_little("Net", 10, 90) is None  # exactly SWAP_LITTLE
    assert swap_saved_little("Net", 9, 91) is not None


def test_each_kind_of_warning_is_given_once() -> None:
    given = CallWarnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        given.give(Once.UNPLANNED, "first")
        given.give(Once.UNPLANNED, "again")  # the same kind: not given again
        given.give(Once.SWAP_LITTLE, "other")
    assert [str(w.message) for w in caught] == ["first", "other"]
    assert not given.due(Once.UNPLANNED) and given.due(Once.HELD_OUTSIDE)
