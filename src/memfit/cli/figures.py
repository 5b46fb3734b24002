"""The figures the command line writes (matplotlib, Agg backend: no display needed).

``timeline_figure``: (a) live tensor memory over one training step for every policy on one set of
axes, time as a fraction of each policy's step so that policies of different speed line up, with a
dashed line where each policy's forward (and loss) ended and backward began; (b) measured peak per
policy as bars, memfit's prediction as a black tick. ``pareto_figure``: the trade-off the budget
planner sees, predicted peak against estimated recompute cost, one point per plan on the frontier.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memfit.cli.steps import PolicyResult

__all__ = ["timeline_figure", "pareto_figure", "POLICY_COLORS"]

MIB = 2**20

#: Colours by policy; budget policies and others take the remaining ones in order.
POLICY_COLORS = {
    "none": "tab:gray",
    "speed": "tab:blue",
    "memory": "tab:green",
    "collection": "tab:purple",
}
_OTHER_COLORS = ("tab:orange", "tab:red", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")


def _pyplot() -> Any:
    # Imported here, for figures alone: matplotlib.pyplot took 5 s to import on a loaded CPU.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colors(labels: Sequence[str]) -> dict[str, str]:
    out, others = {}, iter(_OTHER_COLORS * 4)
    for label in labels:
        out[label] = POLICY_COLORS.get(label) or next(others)
    return out


def _save(plt: Any, fig: Any, path: Path) -> Path:
    """Lay ``fig`` out, write it to ``path`` (making its folder) and close it."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def timeline_figure(results: Sequence[PolicyResult], path: Path, title: str) -> Path:
    plt = _pyplot()
    colors = _colors([r.label for r in results])
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(12, 4.5), width_ratios=[2, 1])
    for r in results:
        c = colors[r.label]
        end = max(r.measured_s, 1e-12)
        ts = [t / end for t, _ in r.timeline]
        bs = [b / MIB for _, b in r.timeline]
        ax_t.step(
            ts, bs, where="post", color=c, label=f"{r.label} (peak {r.peak_bytes / MIB:.1f} MiB)"
        )
        ax_t.axvline(r.forward_end, color=c, linestyle="--", linewidth=1)
    ax_t.set_xlim(0, 1)
    top = max((b for r in results for _, b in r.timeline), default=0) / MIB
    ax_t.set_ylim(0, max(top, 1e-3) * 1.4)  # headroom for the legend
    ax_t.set_xlabel("fraction of the training step (dashed: forward ends, backward starts)")
    ax_t.set_ylabel("live tensor memory above step start (MiB)")
    sparse = all(len(r.timeline) <= 2 for r in results)  # CUDA: measure records the end points
    ax_t.set_title(
        "(a) memory over one training step"
        + (" (only start and end recorded on this device)" if sparse else "")
    )
    ax_t.legend(loc="upper right", framealpha=0.9, fontsize=9)

    xs = list(range(len(results)))
    ax_b.bar(
        xs,
        [r.peak_bytes / MIB for r in results],
        color=[colors[r.label] for r in results],
        label="measured",
    )
    ax_b.scatter(
        xs,
        [r.predicted_peak_bytes / MIB for r in results],
        color="black",
        marker="_",
        s=600,
        zorder=3,
        label="predicted by memfit",
    )
    # Labels such as "budget 50%" are wider than a bar: one word a line, so neighbours never
    # overlap; headroom above the tallest bar keeps the legend off the bars.
    ax_b.set_xticks(xs, [r.label.replace(" ", "\n") for r in results])
    ax_b.set_ylim(0, max(r.peak_bytes for r in results) / MIB * 1.35)
    ax_b.set_ylabel("peak tensor memory (MiB)")
    ax_b.set_title("(b) peak memory per policy")
    ax_b.legend(loc="upper right", framealpha=0.9, fontsize=9)
    fig.suptitle(title)
    return _save(plt, fig, path)


def pareto_figure(
    points: Sequence[Any], path: Path, title: str, policies: Sequence[PolicyResult] = ()
) -> Path:
    """``points``: the planner's frontier (``peak_bytes``, ``recompute_seconds``, sorted by peak).

    ``policies``, if given, are drawn as vertical lines at their predicted peaks for orientation.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [p.peak_bytes / MIB for p in points]
    ys = [p.recompute_seconds * 1e3 for p in points]
    ax.step(xs, ys, where="post", color="black", alpha=0.4)
    ax.plot(xs, ys, "o", color="black", label=f"plans on the frontier ({len(points)})")
    colors = _colors([r.label for r in policies])
    for r in policies:
        ax.axvline(
            r.predicted_peak_bytes / MIB,
            color=colors[r.label],
            linestyle="--",
            linewidth=1,
            label=f"{r.label} (predicted peak)",
        )
    ax.set_xlabel("predicted peak tensor memory of one step (MiB)")
    ax.set_ylabel("estimated recomputation time per step (ms)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, framealpha=0.9)
    ax.set_title(title)
    return _save(plt, fig, path)
