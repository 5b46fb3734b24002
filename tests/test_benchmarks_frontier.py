"""``benchmarks/budget_frontier.py``'s comparison at equal peak and
``benchmarks/frontier_history.py``'s table of runs: the numbers the README's "never slower than
torch.compile" rests on, checked on literal points.

The scripts are not part of the package: ``budget_frontier`` is loaded from its file (``runpy``),
``frontier_history`` imported with ``benchmarks/`` on the path, as it imports its sibling.
"""

from __future__ import annotations

import importlib
import json
import random
import runpy
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from clitools import ROOT

_FRONTIER = runpy.run_path(str(ROOT / "benchmarks" / "budget_frontier.py"))
equal_peak_comparison = _FRONTIER["equal_peak_comparison"]
pooled_medians = _FRONTIER["_pooled_medians"]
paired_interval = _FRONTIER["paired_interval"]
same_program_pairs = _FRONTIER["same_program_pairs"]
same_program_summary = _FRONTIER["same_program_summary"]


def point(peer: str, setting: str, peak: int, times: list[float], program: str | None) -> dict:
    """A measured point as ``budget_frontier.py`` records it."""
    rec: dict[str, Any] = {
        "peer": peer,
        "setting": setting,
        "status": "ok",
        "peak_bytes": peak,
        "times_s": times,
        "time_s": sorted(times)[len(times) // 2],  # odd counts here: the median
        "time_min_s": min(times),
    }
    if program is not None:
        rec["program"] = program
    return rec


# Two torch.compile settings compile one program "p" (medians 10 and 12, pooled 11); memfit's
# two settings pick one plan "m" (medians 9 and 13, pooled 11); a faster torch.compile point
# peaks just above the 1.05x tolerance and must not count.
POINTS = [
    point("torch.compile", "budget 0.8", 100, [10.0, 10.0, 12.0], "p"),
    point("torch.compile", "budget 0.9", 100, [8.0, 12.0, 12.0], "p"),
    point("torch.compile", "budget 1", 106, [1.0, 1.0, 1.0], "q"),
    point("memfit", "budget 0.6", 100, [9.0, 9.0, 9.0], "m"),
    point("memfit", "budget 0.5", 100, [13.0, 13.0, 13.0], "m"),
    point("eager", "plain", 200, [5.0, 5.0, 5.0], None),
]


def test_pooled_medians_pool_the_steps_of_one_program() -> None:
    assert pooled_medians(POINTS[:2]) == [11.0, 11.0]
    # a point without a program is its own
    assert pooled_medians([POINTS[0], POINTS[5]]) == [10.0, 5.0]


def test_equal_peak_comparison_takes_the_fastest_peer_within_the_tolerance() -> None:
    rows = {r["memfit"]: r for r in equal_peak_comparison(POINTS)}
    fast = rows["budget 0.6"]["peers"]["torch.compile"]
    assert fast["setting"] == "budget 0.8"  # fastest median at <= 1.05x; "budget 1" peaks 1.06x
    assert fast["time_ratio"] == pytest.approx(9 / 10)
    assert fast["min_time_ratio"] == pytest.approx(9 / 8)
    assert fast["pooled_time_ratio"] == pytest.approx(11 / 11)
    slow = rows["budget 0.5"]["peers"]["torch.compile"]
    assert slow["time_ratio"] == pytest.approx(13 / 10)
    assert slow["pooled_time_ratio"] == pytest.approx(1.0)  # one plan, one pooled median
    assert rows["budget 0.6"]["peers"]["eager/checkpoint_sequential"] is None  # eager: 2x peak
    # turn by turn: "m" steps (9+13)/2 = 11 each against "p"'s 9, 11, 12: median of 11/9, 1, 11/12
    assert fast["paired_time_ratio"] == pytest.approx(1.0)


def test_paired_ratio_divides_out_the_drift_between_turns() -> None:
    # The machine slows 2x and 4x over the run while the peer's last turn ran on a quiet spell:
    # medians say memfit is 1.8x slower, the turns that ran together say it is 0.91x.
    points = [
        point("torch.compile", "budget 0.8", 100, [11.0, 22.0, 9.0], "p"),
        point("torch.compile", "budget 0.5", 100, [44.0, 44.0, 44.0], "q"),  # slower every turn
        point("memfit", "budget 0.6", 100, [10.0, 20.0, 40.0], "m"),
    ]
    row = equal_peak_comparison(points)[0]["peers"]["torch.compile"]
    assert row["time_ratio"] == pytest.approx(20 / 11)
    # against each peer program turn by turn (10/11, 20/22, 40/9 and 10/44, 20/44, 40/44), the
    # one memfit fares worst against
    assert row["paired_time_ratio"] == pytest.approx(10 / 11)
    lo, hi = row["paired_interval"]
    assert lo <= row["paired_time_ratio"] <= hi


def _noisy(scale: float, n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [scale * rng.uniform(0.9, 1.1) for _ in range(n)]


def test_the_turn_by_turn_interval_separates_a_real_gap_from_noise() -> None:
    """Both sides drawn alike: the interval holds 1. memfit 10% slower every turn under the same
    10% noise: the interval lies wholly above 1. Each interval holds its own median."""
    peer = _noisy(1.0, 80, seed=1)
    for mine, above in ((_noisy(1.0, 80, seed=2), False), (_noisy(1.1, 80, seed=2), True)):
        lo, hi = paired_interval(mine, peer, 2)
        ratios = sorted(a / b for a, b in zip(mine, peer))
        assert lo <= (ratios[39] + ratios[40]) / 2 <= hi
        assert (lo > 1) == above and hi > 1
    # reproducible: a report's interval does not change when it is written again
    assert paired_interval(mine, peer, 2) == paired_interval(mine, peer, 2)


def test_the_interval_resamples_whole_turns() -> None:
    """One turn's steps move together. Turns of (1, 3) and (2, 2): any resample of whole turns
    has median 2, so the interval is that point; resampled step by step it would not be."""
    mine, peer = [1.0, 3.0, 2.0, 2.0], [1.0] * 4
    assert paired_interval(mine, peer, 2) == (2.0, 2.0)
    lo, hi = paired_interval(mine, peer, 1)
    assert lo < 2.0 < hi
    assert paired_interval(mine, peer, 4) == (2.0, 2.0)  # one turn: nothing to resample


def test_settings_of_one_program_are_compared_with_each_other_as_an_a_a_check() -> None:
    pairs = same_program_pairs(POINTS, 1)
    # "p" (torch.compile 0.8 and 0.9) and "m" (memfit 0.6 and 0.5): one pair each; "q" and
    # eager (no program) have no partner
    assert [(p["peer"], p["settings"]) for p in pairs] == [
        ("torch.compile", ["budget 0.8", "budget 0.9"]),
        ("memfit", ["budget 0.6", "budget 0.5"]),
    ]
    # turn by turn: 10/8, 10/12, 12/12 -> median 1.0; 9/13 every turn
    assert pairs[0]["paired_time_ratio"] == pytest.approx(1.0)
    assert pairs[1]["paired_time_ratio"] == pytest.approx(9 / 13)
    summary = same_program_summary(pairs)
    # the distance from 1 either way round: 13/9 for memfit's pair, whose interval excludes 1
    assert summary == {
        "pairs": 2,
        "widest": pytest.approx(13 / 9),
        "median": pytest.approx((1 + 13 / 9) / 2),
        "beyond_noise": 1,
    }
    assert same_program_summary(same_program_pairs(POINTS[2:4], 1)) is None
    # a failed setting's program is not compared
    failed = {**POINTS[1], "status": "failed"}
    assert len(same_program_pairs([POINTS[0], failed], 1)) == 0


@pytest.fixture
def history(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("frontier_history")


def write_run(path: Path, date: str, models: list[dict[str, Any]], **run: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"date_utc": date, "parameters": {"rounds": 3}, "models": models, **run}
    path.write_text(json.dumps(record))


def test_history_lists_every_run_oldest_first_with_each_statistic(
    history: ModuleType, tmp_path: Path
) -> None:
    alone = [point("memfit", "mode memory", 50, [1.0, 1.0, 1.0], "z")]  # no peer at its peak
    write_run(
        tmp_path / "later" / "budget_frontier_inductor.json",
        "2026-11-25T10:00:00+00:00",
        [{"name": "toy", "points": POINTS}, {"name": "lonely", "points": alone}],
    )
    write_run(
        tmp_path / "earlier" / "budget_frontier_inductor.json",
        "2026-11-24T10:00:00+00:00",
        [{"name": "toy", "points": POINTS[:4]}],
    )
    write_run(  # a quick run is not a run of record
        tmp_path / "later" / "budget_frontier_inductor_quick.json",
        "2026-11-26T10:00:00+00:00",
        [{"name": "toy", "points": POINTS}],
    )
    write_run(  # a GPU run: its file named for its device and sizes, its row for the GPU
        tmp_path / "gpu" / "budget_frontier_inductor_cuda_batch8x_points.json",
        "2026-11-27T10:00:00+00:00",
        [{"name": "toy", "points": POINTS[:4]}],
        parameters={"rounds": 3, "device": "cuda:0"},
        machine={"gpu": "NVIDIA H100 80GB HBM3"},
    )
    rows = [line for line in history.table(tmp_path).splitlines() if line.startswith("| [")]
    assert len(rows) == 3  # the model with no torch.compile point at its peak has no row
    assert rows[0].startswith(
        "| [earlier](earlier/budget_frontier_inductor.md) | 2026-11-24T10:00 | CPU | toy |"
    )
    assert rows[2].startswith(
        "| [gpu](gpu/budget_frontier_inductor_cuda_batch8x_points.md) | 2026-11-27T10:00 | "
        "NVIDIA H100 80GB HBM3 | toy | 3 | 1 | 0.90, 0.90 |"
    )
    # earlier: one memfit point, ratios 0.90 (medians), 1.12 (fastest), 9/11 (pooled: "p"),
    # turn by turn the median of 9/9, 9/11, 9/12; A/A: "p"'s two settings, 1.00 apart
    assert rows[0].endswith(
        "| toy | 3 | 1 | 0.90, 0.90 | 1.12, 1.12 | 0.82, 0.82 | 0.82, 0.82 | 0 | 1, 1.00, 0 |"
    )
    # later: budget 0.6 and 0.5, medians 0.90 and 1.30; pooled and turn by turn both 1.00;
    # A/A: memfit's two settings of "m" too, 13/9 apart every turn
    assert rows[1].endswith(
        "| toy | 3 | 2 | 1.10, 1.30 | 1.38, 1.62 | 1.00, 1.00 | 1.00, 1.00 | 0 | 2, 1.44, 1 |"
    )


def test_history_says_how_a_run_in_turns_timed_its_steps(history: ModuleType) -> None:
    assert history._timed({"rounds": 41}) == "41"
    turns = {"rounds": 21, "settle": 1, "steps_per_turn": 2}
    assert history._timed(turns) == "42 (21 turns of 1 untimed + 2)"
