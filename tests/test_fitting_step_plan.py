"""memfit.fitting.step_plan: inputs at another size (real and meta), and the one
call of memfit.plan, which refuses a meta model until memfit.plan takes device=."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memfit.fitting import step_plan
from memfit.fitting.step_plan import size_of, with_size
from memfit.planning.policy import parse_policy


def test_inputs_at_another_size_repeat_rows_and_leave_shared_tensors() -> None:
    ids = torch.arange(6).reshape(2, 3)
    mask = torch.ones(1, 3)
    args, kwargs = with_size(((ids,), {"mask": mask}), 0, 2, 5)
    assert args[0].tolist() == [[0, 1, 2], [3, 4, 5], [0, 1, 2], [3, 4, 5], [0, 1, 2]]
    assert kwargs["mask"] is mask
    longer = with_size(ids, 1, 3, 4)
    assert longer.tolist() == [[0, 1, 2, 0], [3, 4, 5, 3]]
    meta = with_size(torch.empty(2, 3, device="meta", requires_grad=True), 0, 2, 7)
    assert meta.is_meta and meta.shape == (7, 3) and meta.requires_grad
    assert size_of((ids,), {}, 1) == 3
    both = with_size({"input_ids": ids, "labels": ids}, 0, 2, 3)
    assert both["labels"] is both["input_ids"]
    with pytest.raises(ValueError, match="no input tensor has a dimension 2"):
        size_of((ids,), {}, 2)


def test_a_meta_model_goes_to_memfit_plan_with_the_target_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """plan_step passes the target's type to memfit.plan, under autocast where asked: on the CPU
    stand-ins a meta model is planned on, whose ops dispatch through CPU autocast."""
    calls = []

    def plan(
        model: nn.Module, *args: object, policy: object, device: str = "cpu", **kwargs: object
    ) -> str:
        calls.append((device, policy, torch.is_autocast_enabled("cpu"), args, kwargs))
        return "planned"

    monkeypatch.setattr(step_plan, "memfit_plan", plan)
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    x = torch.empty(2, 4, device="meta")
    policy = parse_policy("memory")
    got = step_plan.plan_step(model, (x,), {"k": 1}, policy, "cuda", torch.bfloat16)
    assert got == "planned"
    assert calls == [("cuda", policy, True, (x,), {"k": 1})]


def test_autocast_for_a_device_type_this_machine_lacks_is_set_and_put_back() -> None:
    before = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
    with step_plan._autocast("cuda", torch.bfloat16):
        assert torch.is_autocast_enabled("cuda")
        assert torch.get_autocast_dtype("cuda") == torch.bfloat16
    assert (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")) == before
