"""Scratch memory is measured on real tensors, without touching the user's RNG stream, and without
disturbing a measurement or a profiler session around the first (capturing) call."""

import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity

import memfit
from conftest import CUDA
from measuring import FLOATS_PER_MB, MB
from memfit._compat import cpu_memory_device_types, profiler_events
from memfit.analysis import op_scratch
from memfit.analysis.op_scratch import measure_op_memory
from memfit.bench.graphs import joint_graphs
from memfit.bench.zoo import case


def _conv_graph():
    model = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.Dropout(0.5))
    (jg,) = joint_graphs(model, torch.randn(4, 8, 32, 32))
    return jg


def test_convolution_scratch_is_measured_and_rng_untouched() -> None:
    jg = _conv_graph()
    state = torch.get_rng_state()
    scratch = measure_op_memory(jg.nodes).scratch
    assert torch.equal(torch.get_rng_state(), state)
    assert all(v > 0 for v in scratch.values())
    assert not any(n.target is torch.ops.aten.native_dropout.default for n in scratch)
    conv_bwd = [n for n in jg.backward if n.target is torch.ops.aten.convolution_backward.default]
    assert conv_bwd and all(n in scratch for n in conv_bwd)  # oneDNN keeps buffers on CPU


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_attention_kernels_are_measured_unless_they_draw_dropout(monkeypatch, dropout_p) -> None:
    """SDPA's kernels are tagged random for their dropout; at p = 0 they draw nothing and run
    (on CUDA the efficient backward's workspace was missed: a step measured 1.6x its
    prediction), with dropout they are never run. The RNG stream is untouched either way."""
    model = nn.TransformerEncoderLayer(32, 4, 64, dropout=dropout_p, batch_first=True)
    (jg,) = joint_graphs(model, torch.randn(2, 64, 32))
    ran: list[str] = []
    real = op_scratch._scratch_of_calls

    def spy(calls, dev):
        ran.extend(c.op for c in calls)
        return real(calls, dev)

    monkeypatch.setattr(op_scratch, "_scratch_of_calls", spy)
    state = torch.get_rng_state()
    measure_op_memory(jg.nodes)
    assert torch.equal(torch.get_rng_state(), state)
    attention = [op for op in ran if "scaled_dot_product" in op]
    if dropout_p:
        assert not attention
    else:
        assert any("backward" not in op for op in attention), ran
        assert any("backward" in op for op in attention), ran


def test_a_graph_with_symbolic_sizes_is_measured_at_its_hints() -> None:
    """Sizes captured as symbols (a size that varied between calls) are measured at the sizes of
    the call captured: the same scratch as a capture at those sizes (it raised "unhashable type:
    non-nested SymInt" before)."""
    model = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1))
    (dynamic,) = joint_graphs(model, torch.randn(4, 8, 32, 32), dynamic=True)
    (static,) = joint_graphs(model, torch.randn(4, 8, 32, 32))
    assert dynamic.symbols

    def by_op(jg) -> list[tuple[str, int]]:
        return sorted((str(n.target), v) for n, v in measure_op_memory(jg.nodes).scratch.items())

    measured = by_op(dynamic)
    assert measured and measured == by_op(static)


def test_inputs_are_materialised_one_op_at_a_time(monkeypatch) -> None:
    c = case("unet")
    (jg,) = joint_graphs(c.make_model(), *c.make_inputs()[0])
    alive: list[tuple[weakref.ref, int]] = []
    held: list[int] = []
    materialize = op_scratch._materialize

    def watched(spec, device, gen):
        t = materialize(spec, device, gen)
        alive.append((weakref.ref(t.untyped_storage()), t.untyped_storage().nbytes()))
        held.append(sum(n for ref, n in alive if ref() is not None))
        return t

    monkeypatch.setattr(op_scratch, "_materialize", watched)
    assert measure_op_memory(jg.nodes).scratch

    def input_bytes(node):
        return sum(
            a.meta["val"].untyped_storage().nbytes()
            for a in node.args
            if isinstance(a, torch.fx.Node)
        )

    per_op = {op_scratch._signature(n): input_bytes(n) for n in jg.nodes if op_scratch._runnable(n)}
    # What the measurement holds is one op's inputs at a time, not every op's at once.
    assert max(held) == max(per_op.values()) < sum(per_op.values()) / 4


def _memory_peak(prof) -> tuple[int, int]:
    """(peak, end) of the CPU ``[memory]`` events of a finished torch.profiler session."""
    cpu = cpu_memory_device_types()
    events = sorted(
        (ev.start_ns(), ev.nbytes())
        for ev in profiler_events(prof)
        if ev.name() == "[memory]" and ev.device_type() in cpu
    )
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak, live


def _spy_on_subprocess(monkeypatch) -> list[int]:
    """Counts the ops each call of the out-of-process measurement was given."""
    sizes: list[int] = []
    run = op_scratch._scratch_in_subprocess

    def spy(calls):
        sizes.append(len(calls))
        return run(calls)

    monkeypatch.setattr(op_scratch, "_scratch_in_subprocess", spy)
    return sizes


@pytest.mark.slow
def test_inside_a_user_profiler_scratch_is_measured_in_another_process_alike(monkeypatch) -> None:
    jg = _conv_graph()
    here = measure_op_memory(jg.nodes).scratch
    sizes = _spy_on_subprocess(monkeypatch)
    with torch.profiler.profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        kept = torch.empty(FLOATS_PER_MB)
        there = measure_op_memory(jg.nodes).scratch
    assert len(sizes) == 1 and there == here  # every op in one call of the other process
    assert _memory_peak(prof) == (MB, MB)  # the user's session saw its own tensor, and only it
    del kept


def test_a_failed_worker_warns_and_leaves_scratch_out(monkeypatch) -> None:
    monkeypatch.setattr(op_scratch, "_WORKER", "import sys; sys.exit('worker broke')")
    jg = _conv_graph()
    with torch.profiler.profile(activities=[ProfilerActivity.CPU]):
        with pytest.warns(RuntimeWarning, match="exit status 1: worker broke"):
            assert measure_op_memory(jg.nodes).scratch == {}


def _conv_net() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 4, 3, padding=1),
    )
    return model, torch.randn(8, 3, 32, 32)


def _first_and_later_call(wrap_first):
    """A conv net's first (capturing) call wrapped in ``wrap_first``, then a steady-state step."""
    model, x = _conv_net()
    wrapped = memfit.checkpoint(model)

    def step() -> None:
        wrapped(x).square().mean().backward()

    first = wrap_first(step)
    model.zero_grad(set_to_none=True)
    later = memfit.measure(step)
    model.zero_grad(set_to_none=True)
    return first, later.peak_bytes, wrapped.memfit.plan


def _reference_plan():
    """The plan made by a first call outside any profiler (op scratch measured in-process)."""
    model, x = _conv_net()
    wrapped = memfit.checkpoint(model)
    wrapped(x).square().mean().backward()
    return wrapped.memfit.plan


@pytest.mark.slow
def test_measure_around_a_first_call_reports_its_real_peak(monkeypatch) -> None:
    sizes = _spy_on_subprocess(monkeypatch)
    first, steady, plan = _first_and_later_call(memfit.measure)
    assert sizes and sizes[0] > 0  # op scratch was measured, out of this process
    # The capture allocated nothing here (the op runs happened in the worker), so the first
    # call's peak is the step's: exactly, up to what Dynamo itself allocates.
    assert first.peak_bytes > 0
    assert abs(first.peak_bytes - steady) <= 0.1 * steady
    torch.compiler.reset()
    assert plan == _reference_plan()  # scratch measured elsewhere planned the same


@pytest.mark.slow
def test_user_profiler_around_a_first_call_records_the_step(monkeypatch) -> None:
    sizes = _spy_on_subprocess(monkeypatch)

    def profiled(step):
        with torch.profiler.profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
        return prof

    prof, steady, _ = _first_and_later_call(profiled)
    assert sizes and sizes[0] > 0
    peak, _ = _memory_peak(prof)
    assert peak > 0
    assert abs(peak - steady) <= 0.1 * steady


@CUDA
def test_cuda_scratch_nests_inside_measure() -> None:
    model = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1)).cuda()
    (jg,) = joint_graphs(model, torch.randn(4, 8, 32, 32, device="cuda"))
    alone = measure_op_memory(jg.nodes).scratch

    def outer():
        held = torch.empty(4 * FLOATS_PER_MB, device="cuda")
        del held  # the outer's peak so far: 4 MB, which the inner resets must not erase
        return measure_op_memory(jg.nodes).scratch

    m = memfit.measure(outer, device="cuda")
    assert m.result == alone
    assert m.peak_bytes >= 4 * MB


_PLAN_TWICE = """
import torch, torch.nn as nn, memfit
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).cuda()
x = torch.randn(8, 16, device="cuda")
first = memfit.plan(model, x, policy=1.0)
second = memfit.plan(model, x, policy=1.0)
print(first.baseline_peak_bytes, second.baseline_peak_bytes)
"""


@CUDA
def test_cuda_first_call_allocations_kept_for_good_are_not_scratch() -> None:
    """In a fresh process the first matmul allocates cuBLAS's workspace (32 MiB on an H200) and
    keeps it. Measured as that op's scratch, it made a 4 KiB MLP's first plan 32 MiB and the next
    one not (seen on an H200, 2026-11-26): the plan must not depend on what ran before it."""
    src = str(Path(memfit.__file__).resolve().parents[1])
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))
    )
    out = subprocess.run(
        [sys.executable, "-c", _PLAN_TWICE], capture_output=True, text=True, env=env, check=True
    )
    first, second = map(int, out.stdout.split()[-2:])
    assert first == second
    assert first < MB


# ---- the model of op scratch used on fake tensors (NOTE [Op scratch on fake tensors])


class _RuledOps(nn.Module):
    """LayerNorm, dropout, a Python number, BatchNorm: each op the CPU rules model."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.drop = nn.Dropout(0.25)
        self.bn = nn.BatchNorm1d(64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.drop(self.norm(x)) * 0.5 + 1.0)


def _encoder_layer() -> nn.Module:
    return nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)


@pytest.mark.parametrize(
    "model, x",
    [
        (_RuledOps, (64, 64)),
        (lambda: nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True), (2, 64, 32)),
        (
            lambda: nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True),
            (1, 200, 32),
        ),
    ],
    ids=["norms-dropout-numbers", "attention-64", "attention-200"],
)
def test_modelled_scratch_equals_the_measured_scratch_of_every_ruled_cpu_op(model, x) -> None:
    """Each CPU rule gives what running the op measures, on every op it covers here (flash
    attention's forward at two block sizes): a plan on fake tensors counts the same scratch."""
    torch.manual_seed(0)
    (jg,) = joint_graphs(model(), torch.randn(*x))
    modelled = op_scratch.modelled_op_scratch(jg.nodes)
    measured = measure_op_memory(jg.nodes).scratch
    ruled = [n for n in jg.nodes if str(n.target) in op_scratch.SCRATCH_RULES["cpu"]]
    assert ruled
    assert {n.name: modelled.get(n, 0) for n in ruled} == {
        n.name: measured.get(n, 0) for n in ruled
    }
    assert set(modelled) <= set(ruled)  # no op without a rule has modelled scratch


def test_modelled_scratch_for_cuda_is_zero_and_keeps_the_measured_ops_filter() -> None:
    torch.manual_seed(0)
    (jg,) = joint_graphs(_RuledOps(), torch.randn(64, 64))
    assert op_scratch.modelled_op_scratch(jg.nodes, device=torch.device("cuda")) == {}
    big = max(jg.storage_bytes.values())
    assert op_scratch.modelled_op_scratch(jg.nodes, min_bytes=big + 1) == {}


class _Losses(nn.Module):
    """A linear layer and six losses of its output, each returned: one graph for all of them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(16, 16)

    def forward(self, x, y, index, probability):
        o = self.linear(x)
        F = nn.functional
        return (
            F.mse_loss(o, y),
            F.smooth_l1_loss(o, y),
            F.l1_loss(o, y),
            F.cross_entropy(o, index),
            F.nll_loss(o, index),
            F.binary_cross_entropy_with_logits(o, probability),
        )


def test_outputs_are_counted_at_the_size_the_real_op_returns() -> None:
    """A 0-dim loss whose op reduced in place keeps its unreduced buffer (CPU ``mse_loss``,
    ``smooth_l1_loss``: 32x16 floats, fake tensors say 4 bytes); running the op shows it and the
    graph then counts each loss's storage at what plain PyTorch's loss holds."""
    inputs = (
        torch.randn(32, 16),
        torch.randn(32, 16),
        torch.randint(0, 16, (32,)),
        torch.rand(32, 16),
    )
    plain = [loss.untyped_storage().nbytes() for loss in _Losses()(*inputs)]
    assert max(plain) == 32 * 16 * 4  # torch still reduces some in place: the case is real
    (jg,) = joint_graphs(_Losses(), *inputs)
    measured = measure_op_memory(jg.nodes)
    jg.hold_outputs(measured.outputs)
    counted = [jg.bytes_of([out]) for out in jg.fwd_outputs[: len(plain)]]
    assert counted == plain
    # while it runs the op holds its scratch on top of its output's real size, not more
    mse = next(n for n in jg.nodes if n.target is torch.ops.aten.mse_loss.default)
    a, b = torch.randn(32, 16), torch.randn(32, 16)
    running = memfit.measure(lambda: torch.ops.aten.mse_loss.default(a, b, 1)).peak_bytes
    assert measured.outputs[mse] == (32 * 16 * 4,)
    assert measured.scratch[mse] + 32 * 16 * 4 == running
