"""The plan as plain data: sums over graphs and a readable summary."""

from memfit.planning.decision import Decision
from memfit.planning.plan import GraphPlan, Plan
from memfit.units import format_bytes


def _graph(peak: int, kept: int) -> GraphPlan:
    decisions = {"a": Decision.SAVE, "b": Decision.RECOMPUTE, "x": Decision.SAVE}
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
