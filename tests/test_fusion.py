"""Fusible recomputation under Inductor (``planning.fusion``): torch's min-cut asked what else a
plan need not keep, and torch.compile's own plans, as candidates of memfit's frontier."""

from __future__ import annotations

import pytest
import torch

from memfit._compat import min_cut_saved_values
from memfit.analysis.cost import is_compute_heavy, keeping_seconds, node_seconds
from memfit.analysis.simulate import simulate_step
from memfit.bench.graphs import joint_graphs
from memfit.bench.zoo import cifar_resnet, unet
from memfit.planning.frontier import activations, pareto_frontier
from memfit.planning.fusion import (
    COMPILE_BUDGETS,
    fused_plan,
    keeping_written,
    slow_masks,
    torch_compile_kept,
    torch_compile_plans,
    with_fused_recomputation,
)
from memfit.planning.keep_rules import always_kept, keep_all, keep_heavy, keep_min_peak


@pytest.fixture(scope="module", params=["resnet", "unet"])
def graph(request):
    torch.manual_seed(0)
    if request.param == "resnet":
        model, x = cifar_resnet(2, width=8), torch.randn(4, 3, 16, 16)
    else:
        model, x = unet(depth=2, width=4), torch.randn(2, 1, 32, 32)
    (jg,) = joint_graphs(model, x, executor="inductor")
    return jg


def _heavy(nodes):
    return {n for n in nodes if is_compute_heavy(n)}


def test_fused_recomputation_keeps_less_and_recomputes_no_new_heavy_op(graph) -> None:
    for kept in (keep_all(graph), keep_heavy(graph), keep_min_peak(graph)):
        fused = with_fused_recomputation(graph, kept)
        before, after = graph.recomputed_for(kept), graph.recomputed_for(fused)
        assert before <= after, "what the plan recomputes stays recomputed"
        assert _heavy(after) == _heavy(before), "only ops Inductor fuses are added"
        assert graph.bytes_of(fused) <= graph.bytes_of(kept)


def test_fused_recomputation_saves_what_the_resnet_keeps_for_batchnorm() -> None:
    """Pre-activation blocks keep a convolution's output and BatchNorm's; the normalisation is
    recomputed instead: a real saving (on the U-Net the only one was ReLU's masks, kept no more
    on CPU: ``test_on_cpu_no_candidate_keeps_a_boolean_mask``)."""
    torch.manual_seed(0)
    (jg,) = joint_graphs(cifar_resnet(2, width=8), torch.randn(4, 3, 16, 16), executor="inductor")
    everything = keep_all(jg)
    assert jg.bytes_of(with_fused_recomputation(jg, everything)) < jg.bytes_of(everything)


def _relus_after_convolutions(jg):
    """The ReLUs that read a convolution's output and whose output a convolution reads."""
    return {
        n
        for n in jg.forward
        if n.target == torch.ops.aten.relu.default
        and n.args[0].target == torch.ops.aten.convolution.default
        and any(u.target == torch.ops.aten.convolution.default for u in n.users)
    }


def test_a_relu_recomputed_for_a_convolution_is_kept_instead_of_its_input() -> None:
    """A plan keeping a convolution's output to recompute the ReLU the next convolution reads
    keeps the ReLU's output instead: as many bytes, one recomputation less, no higher peak."""
    torch.manual_seed(0)
    (jg,) = joint_graphs(unet(depth=2, width=4), torch.randn(2, 1, 32, 32), executor="inductor")
    relus = _relus_after_convolutions(jg)
    assert len(relus) >= 4
    convolutions = {r.args[0] for r in relus}
    kept = jg.saved_needed((keep_all(jg) - relus) | convolutions)
    assert convolutions <= kept
    assert relus <= jg.recomputed_for(kept), "the plan recomputes them from the convolutions"
    written = keeping_written(jg, kept)
    assert relus <= written
    assert not convolutions & written, "their inputs are no longer kept"
    assert not relus & jg.recomputed_for(written)
    assert jg.recomputed_for(written) < jg.recomputed_for(kept)
    assert jg.bytes_of(written) <= jg.bytes_of(kept)
    assert simulate_step(jg, written).peak_bytes <= simulate_step(jg, kept).peak_bytes
    assert keeping_written(jg, written) == written  # nothing more moves


class _Mixed(torch.nn.Module):
    """Matrix products with what Inductor's decompositions put around them: a square (its
    backward reads ``2 * x`` through a node of neither half), a ReLU between linears, and a
    skip that reads a value after the op that follows it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        s = self.b(h.pow(2))
        return self.c(torch.relu(s)) + s


def _plans(jg):
    plans = [keep_all(jg), keep_heavy(jg), keep_min_peak(jg)]
    plans += [with_fused_recomputation(jg, k) for k in plans]
    heavy_outputs = {n for n in jg.forward if is_compute_heavy(n)}
    return plans + [jg.saved_needed(heavy_outputs)]


@pytest.mark.parametrize("model", ["fixture", "mixed"])
def test_keeping_written_never_keeps_more_nor_peaks_higher(graph, model) -> None:
    if model == "mixed":
        torch.manual_seed(0)
        (graph,) = joint_graphs(_Mixed(), torch.randn(4, 16), executor="inductor")
    for kept in _plans(graph):
        saved = graph.saved_needed(kept)
        written = keeping_written(graph, kept)
        assert graph.bytes_of(written) <= graph.bytes_of(saved)
        assert graph.recomputed_for(written) <= graph.recomputed_for(saved)
        assert _heavy(graph.recomputed_for(written)) <= _heavy(graph.recomputed_for(saved))
        assert simulate_step(graph, written).peak_bytes <= simulate_step(graph, saved).peak_bytes
    # nothing recomputed, nothing to move
    assert keeping_written(graph, keep_all(graph)) == graph.saved_needed(keep_all(graph))


def test_a_value_read_again_later_is_not_moved() -> None:
    """A convolution's output that a skip reads again after the ReLU stays kept as it is:
    keeping the ReLU's output too would hold both between the two reads."""

    class Skip(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Conv2d(2, 2, 3, padding=1)
            self.b = torch.nn.Conv2d(2, 2, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            return self.b(torch.relu(h)) + h

    torch.manual_seed(0)
    (jg,) = joint_graphs(Skip(), torch.randn(2, 2, 8, 8), executor="inductor")
    (relu,) = [n for n in jg.forward if n.target == torch.ops.aten.relu.default]
    kept = jg.saved_needed((keep_all(jg) - {relu}) | {relu.args[0]})
    assert relu in jg.recomputed_for(kept)
    assert keeping_written(jg, kept) == kept


def test_a_value_the_forward_fuses_away_is_not_kept_instead() -> None:
    """The ResNet's fused plan keeps a convolution's output and recomputes BatchNorm's
    normalisation, which the forward fuses into the ReLU's kernel (never written): keeping it
    would write it, so nothing moves."""
    torch.manual_seed(0)
    (jg,) = joint_graphs(cifar_resnet(2, width=8), torch.randn(4, 3, 16, 16), executor="inductor")
    fused = with_fused_recomputation(jg, keep_all(jg))
    assert fused != jg.saved_needed(keep_all(jg)), "the plan recomputes the normalisation"
    assert keeping_written(jg, fused) == fused


def test_a_sum_of_two_kept_convolutions_is_kept_instead_of_both() -> None:
    """A widening stage's first residual sum adds the shortcut's convolution and the block's. A
    plan keeping both only to recompute the sum keeps the sum instead, as torch.compile's plans
    do: fewer bytes, the sum no longer recomputed, no higher peak. The forward fuses the sum
    into BatchNorm's kernel (so one value alone would not move to it): two for one pays."""
    torch.manual_seed(0)
    (jg,) = joint_graphs(cifar_resnet(2, width=8), torch.randn(4, 3, 16, 16), executor="inductor")
    conv = torch.ops.aten.convolution.default
    sums = {  # (the first stage's first sum adds the stem's output, which BatchNorm reads too)
        n
        for n in jg.forward
        if n.target == torch.ops.aten.add.Tensor
        and all(getattr(a, "target", None) == conv and len(a.users) == 1 for a in n.args[:2])
    }
    assert len(sums) == 2, "the two stages that widen"
    addends = {a for s in sums for a in s.args[:2]}
    kept = jg.saved_needed(keep_heavy(jg))  # every convolution's output, the rest recomputed
    assert addends <= kept
    assert sums <= jg.recomputed_for(kept)
    written = keeping_written(jg, kept)
    assert sums <= written
    assert not addends & written
    assert jg.bytes_of(written) < jg.bytes_of(kept)
    assert jg.recomputed_for(written) < jg.recomputed_for(kept)
    assert simulate_step(jg, written).peak_bytes <= simulate_step(jg, kept).peak_bytes
    assert sums <= torch_compile_kept(jg, 0.8)


def test_random_values_are_not_moved() -> None:
    """A dropout's output, kept whatever the plan (random), is not traded for the ReLU after it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.ReLU(), torch.nn.Linear(16, 4)
    )
    (jg,) = joint_graphs(model, torch.randn(4, 8), executor="inductor")
    relus = {n for n in jg.forward if n.target == torch.ops.aten.relu.default}
    kept = jg.saved_needed(keep_all(jg) - relus)
    assert relus <= jg.recomputed_for(kept)
    assert any(jg.never_recompute(r.args[0]) for r in relus), "the ReLU reads the dropout"
    assert keeping_written(jg, kept) == kept


def test_the_unet_frontier_recomputes_no_relu_a_convolution_reads_from_a_kept_input() -> None:
    torch.manual_seed(0)
    (jg,) = joint_graphs(unet(depth=2, width=4), torch.randn(2, 1, 32, 32), executor="inductor")
    relus = _relus_after_convolutions(jg)
    fused = [p for p in pareto_frontier(jg) if p.source.startswith("fused")]
    assert fused
    for p in fused:
        recomputed = jg.recomputed_for(p.kept)
        assert not {r for r in relus if r in recomputed and r.args[0] in p.kept}, p.source
    assert fused_plan(jg, keep_heavy(jg)) == keeping_written(
        jg, with_fused_recomputation(jg, keep_heavy(jg))
    )


def test_random_and_impure_values_stay_kept(graph) -> None:
    fused = with_fused_recomputation(graph, keep_heavy(graph))
    for n in graph.forward:
        if graph.never_recompute(n) and n in graph.saved_needed(graph.forward):
            assert n in fused


def test_solving_leaves_the_graph_as_it_was(graph) -> None:
    before = {n.name: dict(n.meta).get("recompute") for n in graph.nodes}
    code = graph.module.code
    with_fused_recomputation(graph, keep_min_peak(graph))
    torch_compile_kept(graph, 0.5)
    assert {n.name: n.meta.get("recompute") for n in graph.nodes} == before
    assert graph.module.code == code


def test_torch_compile_plans_keep_less_under_smaller_budgets(graph) -> None:
    kept = [graph.bytes_of(torch_compile_kept(graph, b)) for b in sorted(COMPILE_BUDGETS)]
    assert kept == sorted(kept)
    assert kept[0] < kept[-1]


def test_frontier_is_not_beaten_by_any_torch_compile_plan(graph) -> None:
    points = pareto_frontier(graph)
    assert any(p.source.startswith("torch.compile") or p.source.startswith("fused") for p in points)
    forward = set(graph.forward)
    gap = 0.01 * points[-1].peak_bytes  # the frontier's min_gap: plain autograd's peak
    for b in COMPILE_BUDGETS:
        sim = simulate_step(graph, torch_compile_kept(graph, b))
        kept = torch_compile_kept(graph, b)
        cost = sum(node_seconds(n, graph.sizes, fused=True) for n in sim.backward if n in forward)
        cost += keeping_seconds(graph, activations(graph, kept))
        # some frontier point peaks no higher (within the gap) and costs no more
        assert any(
            p.peak_bytes <= sim.peak_bytes + gap and p.cost_seconds <= cost + 1e-12 for p in points
        ), b


def test_eager_frontier_has_no_inductor_candidates() -> None:
    torch.manual_seed(0)
    (jg,) = joint_graphs(cifar_resnet(1, width=8), torch.randn(2, 3, 16, 16))
    assert not jg.fused_elementwise
    sources = {p.source for p in pareto_frontier(jg)}
    assert not any(s.startswith(("fused", "torch.compile")) for s in sources)


def _min_cut_alone(jg):
    """What torch's min-cut keeps of ``jg`` with nothing forced but random and impure values."""
    return set(
        min_cut_saved_values(
            jg.module,
            num_fwd_outputs=jg.num_fwd_outputs,
            static_lifetime_input_indices=sorted(jg.static_inputs),
            must_save={n for n in jg.forward if jg.never_recompute(n)},
        )
    )


def test_on_cpu_no_candidate_keeps_a_boolean_mask(graph) -> None:
    masks = slow_masks(graph)
    assert masks, "ReLU's backward reads x <= 0: the graph has masks to keep or not"
    assert all(n.meta["val"].dtype == torch.bool for n in masks)
    for kept in (keep_all(graph), keep_heavy(graph), keep_min_peak(graph)):
        assert not with_fused_recomputation(graph, kept) & masks
    for b in COMPILE_BUDGETS:
        assert not torch_compile_kept(graph, b) & masks, b
    assert not any(p.kept & masks for p in pareto_frontier(graph))


def test_torch_min_cut_alone_keeps_the_unet_relu_masks() -> None:
    """Why the rule exists: where a ReLU's output reaches the backward only through a max-pool
    and a concatenation (a U-Net's skips), torch's min-cut keeps its mask, a quarter of its bytes,
    instead; the tests above would pass vacuously if it never did."""
    torch.manual_seed(0)
    (jg,) = joint_graphs(unet(depth=2, width=4), torch.randn(2, 1, 32, 32), executor="inductor")
    assert _min_cut_alone(jg) & slow_masks(jg)


def test_torch_compile_plans_solved_together_are_each_budgets_own(graph, monkeypatch) -> None:
    """Solved together, the budgets share their min-cuts (fewer solves) and each gets the plan it
    gets alone."""
    from memfit import _compat

    solves = _count_calls(monkeypatch, _compat._partitioners, "solve_min_cut")
    counted = _compat._partitioners.solve_min_cut
    alone = [torch_compile_kept(graph, b) for b in COMPILE_BUDGETS]
    one_by_one = len(solves)
    together = torch_compile_plans(graph, COMPILE_BUDGETS)
    assert together == alone
    assert len(solves) - one_by_one < one_by_one / 2
    assert _compat._partitioners.solve_min_cut is counted  # put back as it was


def test_candidates_are_the_same_with_torchs_default_max_flow(graph, monkeypatch) -> None:
    """memfit solves torch's min-cuts with Boykov-Kolmogorov (``_compat.MIN_CUT_MAX_FLOW``);
    networkx's cut is the same for every maximum flow, so each candidate is the one torch's own
    preflow-push gives, and networkx is left as it was."""
    import networkx

    from memfit import _compat

    plans = [keep_all(graph), keep_heavy(graph), keep_min_peak(graph)]

    def candidates():
        return [with_fused_recomputation(graph, kept) for kept in plans] + torch_compile_plans(
            graph, COMPILE_BUDGETS
        )

    solved = candidates()
    assert networkx.minimum_cut.__name__ == "minimum_cut"  # networkx's own again
    monkeypatch.setattr(_compat.aot_partitioning, "MIN_CUT_MAX_FLOW", "preflow_push")
    assert candidates() == solved
    assert len({frozenset(s) for s in solved}) > 3  # the cuts differ: the check has teeth


def test_a_graph_is_classified_once_for_all_its_candidates(monkeypatch) -> None:
    """torch's node classification depends on the graph alone: one per graph, shared by every
    candidate, with the plans of a classification made for each solve."""
    from memfit import _compat

    torch.manual_seed(0)
    (jg,) = joint_graphs(cifar_resnet(1, width=8), torch.randn(2, 3, 16, 16), executor="inductor")
    calls = _count_calls(monkeypatch, _compat._partitioners, "classify_nodes")
    fused = [with_fused_recomputation(jg, keep_all(jg)), *torch_compile_plans(jg, (0.5, 0.2))]
    assert len(calls) == 1
    assert fused[0] == with_fused_recomputation(jg, keep_all(jg)) and len(calls) == 1
    kwargs = dict(
        num_fwd_outputs=jg.num_fwd_outputs,
        static_lifetime_input_indices=sorted(jg.static_inputs),
        must_recompute=slow_masks(jg),
        must_save={n for n in jg.forward if jg.never_recompute(n)},
    )
    fresh = _compat.min_cut_saved_values_at(jg.module, memory_budgets=[0.5, 0.2], **kwargs)
    assert len(calls) == 2  # classified again without a node_info
    assert [jg.saved_needed(set(s) | always_kept(jg)) for s in fresh] == fused[1:]


def _count_calls(monkeypatch, owner, name: str) -> list:
    """Wrap ``owner.name`` for the test; the list it returns grows by each call's arguments."""
    calls: list = []
    real = getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls
