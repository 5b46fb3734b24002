"""memfit.Options and resolve: checkpoint, step and plan arguments, checked at the boundary."""

from __future__ import annotations

import pytest
import torch

import memfit
from memfit.execution.options import resolve
from memfit.planning.budget import Budget
from memfit.planning.policy import Policy


def test_choices_are_their_strings_and_refuse_others_naming_them() -> None:
    assert memfit.Executor.INDUCTOR == "inductor" and str(memfit.Executor.EAGER) == "eager"
    options = memfit.Options(attention="off", offload_to="disk")
    assert options.attention is memfit.Attention.OFF
    assert options.offload_to is memfit.OffloadTarget.DISK
    with pytest.raises(ValueError, match="'auto', 'off'") as info:
        memfit.Options(attention="flash")
    assert "memfit.Attention" in str(info.value)
    with pytest.raises(ValueError, match="'host', 'disk'"):
        memfit.Options(offload_to="tape")


def test_bad_knobs_are_refused_when_options_are_made() -> None:
    with pytest.raises(TypeError, match="autotune"):
        memfit.Options(autotune="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_shapes"):
        memfit.Options(max_shapes=0)
    with pytest.raises(ValueError, match="positive"):
        memfit.Options(offload_bandwidth=-1.0)
    with pytest.raises(memfit.OffloadError, match="does not exist"):
        memfit.Options(offload_dir="/no/such/directory")
    with pytest.raises(ValueError, match="not a fraction"):
        memfit.Options(host_budget=0.5)  # type: ignore[arg-type]


def test_the_offload_fields_are_what_offload_reads() -> None:
    assert not memfit.Options().offload_given
    assert memfit.Options(offload_min_bytes=1).offload_given
    options = memfit.Options(offload_to="disk", offload_bandwidth=1e9, host_budget="1GiB")
    assert options.offload_given and options.host_budget == "1GiB"  # as written
    assert (options.offload_bandwidth, options.host_budget_bytes) == (1e9, 2**30)
    assert options.offload_destination(torch.device("cpu")) == "disk"
    assert memfit.Options().offload_destination(torch.device("cpu")) == "disk"
    assert memfit.Options().offload_destination(torch.device("cuda")) == "host"
    with pytest.raises(memfit.OffloadError, match="offload_to='disk'"):
        memfit.Options(offload_to="host").offload_destination(torch.device("cpu"))
    with pytest.raises(TypeError):
        memfit.Options("off")  # type: ignore[misc]  # every field is a keyword


def test_resolve_folds_offload_and_autotune_into_the_policy() -> None:
    policy, options, executor = resolve(0.5, True, "inductor", memfit.Options(autotune=True))
    assert policy == Policy("budget", budget=Budget(fraction=0.5), offload=True, autotune=True)
    assert executor is memfit.Executor.INDUCTOR and options.autotune
    assert resolve("memory", False, "eager", None)[0] == Policy("memory")
    with pytest.raises(ValueError, match="offload=True"):
        resolve("memory", False, "eager", memfit.Options(offload_to="disk"))
    with pytest.raises(ValueError, match="goes with a budget"):
        resolve("speed", True, "eager", None)
    with pytest.raises(TypeError, match="memfit.Options"):
        resolve("memory", False, "eager", {"attention": "off"})  # type: ignore[arg-type]
