"""The plan as plain data: sums over graphs and a readable summary."""

import dataclasses

from memfit.planning.decision import Decision
from memfit.planning.plan import GraphPlan, Plan, RegionPlan
from memfit.units import format_bytes


def _graph(peak: int, kept: int) -> GraphPlan:
    decisions = {"a": Decision.KEEP, "b": Decision.RECOMPUTE, "x": Decision.KEEP}
    return GraphPlan(
        policy="memory",
        decisions=decisions,
        kept=("a",),
        recomputed=("b", "c"),
        kept_bytes=kept,
        predicted_peak_bytes=peak,
        baseline_peak_bytes=2 * peak,
        baseline_kept_bytes=2 * kept,
        recompute_flops=10,
        forward_flops=40,
        num_nodes=5,
    )


def test_peaks_of_several_graphs_add_kept_values() -> None:
    plan = Plan("memory", (_graph(100, 30), _graph(50, 20)))
    # both graphs' kept values are alive at once, plus the larger transient (70)
    assert plan.predicted_peak_bytes == 30 + 20 + 70
    assert plan.recomputed == ("b", "c", "b", "c")
    assert plan.recompute_flops == 20


def test_summary_and_units() -> None:
    text = str(Plan("memory", (_graph(3 * 2**20, 2**20),)))
    assert "3.00 MiB" in text and "50%" in text and "25% of one forward" in text
    assert format_bytes(512) == "512 B" and format_bytes(1536) == "1.50 KiB"


def test_saved_lists_the_save_decisions_in_order() -> None:
    assert _graph(10, 5).saved() == ["a", "x"]


def _ordered(peak: int, kept: int, forward: int, out: int, grads: int) -> GraphPlan:
    return dataclasses.replace(
        _graph(peak, kept),
        forward_peak_bytes=forward,
        backward_peak_bytes=peak,
        output_bytes=out,
        parameter_grad_bytes=grads,
    )


def test_a_region_is_one_part_of_the_step_recomputed_in_its_backward() -> None:
    """Graphs inside a region keep their values only while the backward recomputes it: in the
    step's order the region keeps nothing itself (its inputs are the outputs before it), its
    forward holds its graphs' outputs, its backward is its graphs run as a step of their own."""
    outside = _ordered(100, 30, forward=60, out=8, grads=4)
    inner1 = _ordered(40, 20, forward=30, out=6, grads=3)
    inner2 = _ordered(50, 25, forward=35, out=5, grads=2)
    region = RegionPlan("layers.0", "Layer", "model.py:12", input_bytes=8, graphs=(1, 2))
    plan = Plan("memory", (outside, inner1, inner2), regions=(region,))
    part = plan.parts()[1]
    # forward: max(30, 6 + 35); backward: max(30, 2 + 40), then 20 + 6 + max(35, 50)
    assert (part.forward_peak_bytes, part.backward_peak_bytes) == (41, 76)
    assert (part.kept_bytes, part.output_bytes, part.parameter_grad_bytes) == (0, 5, 5)
    # the outside graph's backward with the region's gradients (105); the region's backward
    # with what the outside graph keeps and outputs (38 + 76)
    assert plan.predicted_peak_bytes == max(60, 5 + 100, 38 + 41, 38 + 76) == 114
    assert plan.forward_end_bytes == 30 + 8 + 5  # kept, the region's inputs, its output
    assert plan.kept_bytes == 30 + 8 and plan.kept == ("a",)
    assert plan.recompute_flops == 3 * 10 + 2 * 40  # every graph's, and the region's forward
    text = str(plan)
    assert "recomputed whole  1 call of layers.0 (Layer at model.py:12)" in text
    assert "not in the prediction" in text


def test_what_the_python_between_graphs_held_is_under_the_later_parts() -> None:
    """``held``: measured at each part's forward start beyond what the parts before it keep and
    output (the model's own Python between graphs); a region is one part, measured where its
    first graph starts."""
    first = _ordered(100, 30, forward=60, out=8, grads=4)
    last = _ordered(80, 10, forward=50, out=2, grads=3)
    plan = Plan("none", (first, last))
    assert plan.starts() == [0, 38] and plan.predicted_peak_bytes == 38 + 80
    # the second graph started with 38 + 25 live (eager autograd held 25 more)
    held = plan.with_levels([0, 63])
    assert held.held == (0, 25)
    assert held.predicted_peak_bytes == max(60, 3 + 100, 63 + 50, 63 + 80) == 143
    assert held.forward_end_bytes == 63 + last.forward_end_bytes
    # negative: the Python dropped an output the first graph's part counted
    assert plan.with_levels([0, 30]).predicted_peak_bytes == max(103, 30 + 80)
    assert plan.with_levels([0]) is plan  # not one level per graph: not measured
    inner1 = _ordered(40, 20, forward=30, out=6, grads=3)
    inner2 = _ordered(50, 25, forward=35, out=5, grads=2)
    region = RegionPlan("layers.0", "Layer", "model.py:12", input_bytes=8, graphs=(1, 2))
    regions = Plan("memory", (first, inner1, inner2), regions=(region,))
    assert regions.part_firsts() == [0, 1]
    assert regions.with_levels([0, 40, 55]).held == (0, 2)
    # with a part after the region: what the region's own Python left at its first graph's
    # start is not held through it (at most what is still held after it)
    after = Plan("memory", (first, inner1, inner2, last), regions=(region,))
    assert after.starts() == [0, 38, 43]
    assert after.with_levels([0, 45, 55, 44]).held == (0, 1, 1)
