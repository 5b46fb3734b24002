"""The transfer schedule: when offloaded values leave and come back, and what the link costs."""

from __future__ import annotations

import pytest
import torch

from memfit.analysis.cost import node_seconds
from memfit.analysis.simulate import simulate_step
from memfit.analysis.transfers import Link, offloadable, schedule_transfers, value_bytes
from memfit.bench.graphs import joint_graphs
from memfit.bench.zoo import cifar_resnet
from memfit.planning.keep_rules import keep_all


@pytest.fixture(scope="module")
def setup():
    torch.compiler.reset()
    jg = joint_graphs(cifar_resnet(2, width=8), torch.randn(8, 3, 32, 32))[0]
    kept = keep_all(jg)
    sim = simulate_step(jg, kept)
    seconds = {n: node_seconds(n) for n in jg.nodes}
    return jg, kept, sim, seconds


def test_offloadable_values_own_their_storage(setup) -> None:
    jg, kept, _, _ = setup
    values = offloadable(jg, jg.saved_needed(kept))
    assert values
    outputs = set(jg.fwd_outputs)
    keys = [jg.storages[v][0] for v in values]
    assert len(set(keys)) == len(keys)  # one value per storage: views are never offloaded twice
    for v in values:
        assert v not in outputs and v.op != "placeholder"
        assert jg.storages[v][0] not in jg.primal_keys
        val = v.meta["val"]
        assert val.numel() * val.element_size() == jg.storage_bytes[jg.storages[v][0]]
    big = offloadable(jg, jg.saved_needed(kept), min_bytes=10**9)
    assert big == []


def test_fast_link_moves_values_at_their_last_reader_and_first_use(setup) -> None:
    jg, kept, sim, seconds = setup
    values = offloadable(jg, jg.saved_needed(kept))
    schedule = schedule_transfers(jg, sim.forward, sim.backward, values, Link(1e18, 1e18), seconds)
    assert schedule.stall_seconds == pytest.approx(0.0, abs=1e-12)
    fpos = {n: i for i, n in enumerate(sim.forward)}
    bpos = {n: i for i, n in enumerate(sim.backward)}
    for t in schedule.transfers:
        readers = [fpos[u] for u in sim.forward if t.value in jg.inputs[u]]
        last = max([fpos[t.value], *readers])
        # never before the last reader; after it, only as far as the copy needs
        assert fpos[t.wait_after] >= last
        assert sum(seconds[n] for n in sim.forward[last + 1 : fpos[t.wait_after]]) <= 1e-12
        first = min(bpos[u] for u in sim.backward if t.value in jg.inputs[u])
        # the latest start that leaves the copy its time: starting one node later would not
        assert bpos[t.prefetch_before] <= first
        later = sim.backward[bpos[t.prefetch_before] + 1 : first]
        assert sum(seconds[n] for n in later) <= t.nbytes / 1e18


def test_slow_link_stalls_and_prefetches_earlier(setup) -> None:
    jg, kept, sim, seconds = setup
    values = offloadable(jg, jg.saved_needed(kept))
    fast = schedule_transfers(jg, sim.forward, sim.backward, values, Link(1e18, 1e18), seconds)
    slow_bw = 1e8
    slow = schedule_transfers(
        jg, sim.forward, sim.backward, values, Link(slow_bw, slow_bw), seconds
    )
    moved = sum(t.nbytes for t in slow.transfers)
    assert slow.transfer_seconds == pytest.approx(2 * moved / slow_bw)
    # The link must carry every byte out within the forward and back within the backward: what
    # does not fit in the compute it overlaps is waited for.
    assert slow.stall_seconds >= slow.transfer_seconds - slow.compute_seconds - 1e-9
    assert slow.stall_seconds > fast.stall_seconds
    bpos = {n: i for i, n in enumerate(sim.backward)}
    earlier = [
        bpos[s.prefetch_before] <= bpos[f.prefetch_before]
        for s, f in zip(slow.transfers, fast.transfers)
    ]
    assert all(earlier) and any(
        bpos[s.prefetch_before] < bpos[f.prefetch_before]
        for s, f in zip(slow.transfers, fast.transfers)
    )


def test_offload_lowers_the_simulated_peak_and_holds_the_reloads(setup) -> None:
    jg, kept, sim, seconds = setup
    values = offloadable(jg, jg.saved_needed(kept))
    schedule = schedule_transfers(jg, sim.forward, sim.backward, values, Link(1e18, 1e18), seconds)
    offloaded = simulate_step(jg, kept, transfers=schedule.transfers)
    assert offloaded.peak_bytes < sim.peak_bytes
    assert offloaded.saved_bytes == sim.saved_bytes - schedule.offloaded_bytes
    # Reloading everything at the start of backward brings the whole saved set back.
    first = sim.backward[0]
    early = [type(t)(t.value, t.nbytes, t.wait_after, first) for t in schedule.transfers]
    assert simulate_step(jg, kept, transfers=early).peak_bytes > offloaded.peak_bytes


def test_link_rejects_nonpositive_bandwidth() -> None:
    with pytest.raises(ValueError, match="positive"):
        Link(0.0, 1.0)


def test_copies_that_cannot_overlap_cost_their_time_and_start_late(setup) -> None:
    jg, kept, sim, seconds = setup
    values = offloadable(jg, jg.saved_needed(kept))
    link = Link(1e9, 1e9, latency_s=1e-4, overlap=0.0)
    schedule = schedule_transfers(jg, sim.forward, sim.backward, values, link, seconds)
    # Every copy takes compute's own time: the stall is the whole transfer time, no more.
    assert schedule.stall_seconds == pytest.approx(schedule.transfer_seconds)
    assert schedule.transfer_seconds == pytest.approx(
        sum(2 * (1e-4 + t.nbytes / 1e9) for t in schedule.transfers)
    )
    bpos = {n: i for i, n in enumerate(sim.backward)}
    fast = schedule_transfers(jg, sim.forward, sim.backward, values, Link(1e18, 1e18), seconds)
    for slow_t, fast_t in zip(schedule.transfers, fast.transfers):
        # nothing to gain from a head start: prefetched as late as with an instant link
        assert bpos[slow_t.prefetch_before] >= bpos[fast_t.prefetch_before]


def test_cuda_block_rounding_neither_hides_values_nor_changes_bytes_moved() -> None:
    """On CUDA the simulator counts whole 512-byte blocks (``allocated_bytes``); which values can
    be offloaded, and the bytes a copy moves, stay the tensors' own."""
    torch.compiler.reset()
    model = torch.nn.Sequential(torch.nn.Linear(30, 30), torch.nn.Tanh(), torch.nn.Linear(30, 3))
    (jg,) = joint_graphs(model, torch.randn(5, 30))  # 5x30 fp32 values: 600 bytes each
    saved = jg.saved_needed(keep_all(jg))
    on_cpu = offloadable(jg, saved)
    assert on_cpu and any(value_bytes(jg, v) % 512 for v in on_cpu)
    jg.storage_devices = dict.fromkeys(jg.storage_devices, torch.device("cuda", 0))
    cuda = jg.at(jg.sizes)
    assert cuda.storage_bytes != jg.storage_bytes  # rounded up
    assert offloadable(cuda, saved) == on_cpu
    assert [value_bytes(cuda, v) for v in on_cpu] == [value_bytes(jg, v) for v in on_cpu]
