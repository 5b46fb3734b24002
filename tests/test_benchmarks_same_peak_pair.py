"""``benchmarks/same_peak_pair.py``: its sides, and the kernels it counts per step (what tells
a GPU step bound by launching kernels from one bound by running them).

The script is not part of the package: imported with ``benchmarks/`` on the path, as it imports
its sibling ``budget_frontier``.
"""

from __future__ import annotations

import argparse
import importlib
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

from clitools import ROOT
from conftest import CUDA
from memfit.bench.peers import entry_point
from memfit.bench.runner import Method


@pytest.fixture
def pair(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("same_peak_pair")


def test_sides_parse_and_bad_ones_are_refused(pair: ModuleType) -> None:
    assert pair.parse_side("torch.compile:0.8") == ("torch.compile", "0.8")
    assert pair.parse_side("memfit:none") == ("memfit", "none")
    assert pair.parse_side("memfit-bare:none") == ("memfit-bare", "none")
    assert pair.parse_side("memfit-bare:0.6") == ("memfit-bare", "0.6")
    assert pair.parse_side("memfit-undonated:0.6") == ("memfit-undonated", "0.6")
    assert pair.parse_side("torch.compile-undonated:0.8") == ("torch.compile-undonated", "0.8")
    for bad in (
        "torch.compile:none",
        "memfit:",
        "eager:1.0",
        "memfit-autotune:speed",
        "memfit-bare:fast",
        "torch.compile-undonated:none",
        "eager-undonated:1.0",
    ):
        with pytest.raises(argparse.ArgumentTypeError):
            pair.parse_side(bad)


def _mlp_spec(activation: type[nn.Module]) -> Any:
    """A two-Linear MLP with ``activation`` between them, as the benchmarks' model spec."""
    from budget_frontier import ModelSpec

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 16), activation(), nn.Linear(16, 4))

    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    return ModelSpec("mlp", "MLP", build, (x,), lambda out: out.square().mean(), {}, None)


def test_a_bare_side_steps_memfits_compiled_program_without_its_call_around_it(
    pair: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The diagnostic side: after the wrapper's warm-up its steps call the compiled program
    itself (memfit's per-call Python never runs) and train as the wrapper's steps do."""
    spec = _mlp_spec(nn.Tanh)
    wrapped = pair.side(spec, "memfit", "none")
    bare = pair.side(spec, "memfit-bare", "none")
    assert bare.name == "memfit-bare mode none"

    from memfit.execution.planned_call import PlannedCall

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("memfit's call ran")

    monkeypatch.setattr(PlannedCall, "run", never)
    bare.run_step()
    with pytest.raises(AssertionError, match="memfit's call ran"):
        wrapped.run_step()
    monkeypatch.undo()
    wrapped.run_step()
    for a, b in zip(bare.model.parameters(), wrapped.model.parameters(), strict=True):
        assert a.grad is not None and torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_an_undonated_side_compiles_a_backward_that_reuses_no_saved_value(
    pair: ModuleType, backward_donations: list[list[int]]
) -> None:
    """``memfit-undonated`` plans and steps as ``memfit`` does, its backward compiled with no
    donated input; ``memfit``'s gets its saved values as donated."""
    donated = backward_donations
    spec = _mlp_spec(nn.Sigmoid)
    undonated = pair.side(spec, "memfit-undonated", "none")
    assert undonated.name == "memfit-undonated mode none"
    assert donated and not any(donated)
    donated.clear()
    pair.side(spec, "memfit", "none")
    assert donated and all(donated)


def test_cpu_kernel_counts_see_compiled_graphs_their_kernels_and_ops_outside(
    pair: ModuleType,
) -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    compiled = torch.compile(model)
    x = torch.randn(8, 16)

    def step() -> None:
        (compiled(x) ** 2).mean().backward()  # the loss outside the compiled graph

    method = Method("compiled", model, step, record_failures=False)
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):
        method.run_step()  # compiles forward and backward with kernels as profiler events
    side = pair.profile_side(method, torch.device("cpu"))
    assert side["profile"] and side["profile"][0]["self_ms_per_step"] > 0
    k = side["kernels"]
    assert k["events"]["CPU"] > 0
    assert k["compiled_graph_calls_per_step"] == 2  # the forward graph and the backward graph
    names = {row["kernel"] for row in k["top_kernels"]}
    assert any("addmm" in n or n == "aten::mm" for n in names)  # extern matmuls inside them
    assert any("cpp_fused" in n for n in names)  # Inductor's own kernels
    # pow, mean and their gradients run eagerly, outside both graphs
    assert k["aten_calls_outside_compiled_per_step"] >= 4


def test_two_compiles_of_one_graph_call_the_same_kernels_and_another_graph_does_not(
    pair: ModuleType,
) -> None:
    """What says two sides ran one program: the same calls inside their compiled graphs, once
    the names' graph prefix and kernel index are taken off."""
    x = torch.randn(8, 16)

    def side(name: str, act: nn.Module) -> dict[str, float]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), act, nn.Linear(16, 4))
        compiled = torch.compile(entry_point(model, name))
        method = Method(name, model, lambda: compiled(x).sum().backward(), record_failures=False)
        with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):
            method.run_step()
        calls: dict[str, float] = pair.profile_side(method, torch.device("cpu"))["kernels"][
            "calls_inside"
        ]
        return calls

    first, again, other = side("a", nn.ReLU()), side("b", nn.ReLU()), side("c", nn.Tanh())
    assert any(name.startswith("graph_") for name in again)  # torch.compile's profiler names
    assert pair.kernel_differences(first, again) == []
    assert pair.common_calls(first, again) == sum(first.values())
    differ = pair.kernel_differences(first, other)
    assert differ and any("tanh" in kind for kind, _, _ in differ)
    assert all(a != b for _, a, b in differ)
    assert pair.common_calls(first, other) < sum(first.values())


def test_kernel_kinds_drop_the_graph_prefix_and_the_index(pair: ModuleType) -> None:
    assert pair._kernel_kind("graph_1_cpp_fused_relu_threshold_backward_12") == (
        "cpp_fused_relu_threshold_backward"
    )
    assert pair._kernel_kind("aten::mm") == "aten::mm"
    ref = {"graph_0_cpp_fused_relu_0": 2.0, "aten::mm": 3.0}
    other = {"cpp_fused_relu_4": 2.0, "aten::mm": 3.0, "cpp_fused_clone_9": 1.0}
    assert pair.kernel_differences(ref, other) == [["cpp_fused_clone", 0, 1.0]]
    assert pair.common_calls(ref, other) == 5.0


def test_a_failed_kernel_count_keeps_the_timings_and_says_why(
    pair: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(events: object, cuda: bool) -> dict:
        raise RuntimeError("no CUPTI here")

    monkeypatch.setattr(pair, "kernel_counts", broken)
    method = Method("m", nn.Linear(2, 2), lambda: None)
    side = pair.profile_side(method, torch.device("cpu"))
    counts = side["kernels"]
    assert side["profile"] == []
    assert counts["error"] == "RuntimeError: no CUPTI here"
    table = pair.kernel_table({"m": {"kernels": counts}}, torch.device("cuda"))
    assert table[-1] == "| m | RuntimeError: no CUPTI here |"
    assert pair.kernel_list(counts)[2:] == []  # no kernels listed


@CUDA
def test_cuda_each_sides_profile_sees_the_gpu_kernels_and_the_host_issuing_them(
    pair: ModuleType,
) -> None:
    """Two sides, profiled one after the other as the script does: the H100 run of 2026-11-27
    saw no GPU event in the sessions after a process's first."""
    device = torch.device("cuda")
    for name in ("first", "second"):
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)).to(device)
        x = torch.randn(32, 64, device=device)

        def step(model: nn.Module = model, x: torch.Tensor = x) -> None:
            (model(x) ** 2).mean().backward()

        method = Method(name, model, step, record_failures=False)
        method.run_step()
        k = pair.profile_side(method, device)["kernels"]
        assert "error" not in k, k["error"]
        # forward: 2 matmuls + relu; backward: their gradients; far more than a handful
        assert k["kernels_per_step"] >= 6, (name, k["events"])
        assert k["gpu_busy_ms_per_step"] > 0
        assert k["launches_per_step"] >= 1
        assert k["top_kernels"] and all(row["ms_per_step"] >= 0 for row in k["top_kernels"])
        assert 0 < k["issue_ms"] <= k["wall_ms"]
        # a tiny step's kernels, run back to back, take less than its issuing by the host
        assert 0 < k["queued_gpu_ms"] < k["wall_ms"]
        assert k["queued_starved"] < pair.UNPROFILED
