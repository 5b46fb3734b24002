"""``memfit profile`` on a tiny model, run as a user runs it: exit status, report, figures.

The JSON report is checked against its own published schema (``REPORT_SCHEMA``), and then for
what its numbers must say: the saved activations of this MLP are exactly its two Tanh outputs,
every policy's measured peak is recorded, and the largest-batch search's answer was measured to fit
the budget while the batch one step above it was measured not to.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clitools import explain, png_size, run_memfit
from memfit.cli.report import REPORT_SCHEMA, validate

FACTORIES = "tests/cli_factories.py"
BUDGET = 2**20  # 1 MiB: the tiny MLP fits a few hundred rows


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path]:
    out = tmp_path_factory.mktemp("profile")
    proc = run_memfit(
        "profile",
        f"{FACTORIES}:tiny_mlp",
        "--device",
        "cpu",
        "--policies",
        "none,memory",
        "--budget",
        "1MiB",
        "--batch-step",
        "32",
        "--timing-runs",
        "1",
        "--pareto",
        "--json",
        "--out",
        str(out),
    )
    return proc, out


def test_exit_status_and_tables(profiled) -> None:
    proc, _ = profiled
    assert proc.returncode == 0, explain(proc)
    for title in (
        "activation memory by submodule",
        "largest tensors kept for backward",
        "one training step per policy",
        "largest batch within 1MiB",
    ):
        assert title in proc.stdout, proc.stdout
    assert "Next:" in proc.stdout
    assert "plain PyTorch" in proc.stdout and "vs plain" in proc.stdout  # savings against plain


def test_report_matches_its_schema_and_the_model(profiled) -> None:
    proc, out = profiled
    assert proc.returncode == 0, explain(proc)
    report = json.loads((out / "profile.json").read_text())
    assert validate(report, REPORT_SCHEMA) == []
    assert report["parameters"]["count"] == 32 * 128 + 128 + 128 * 128 + 128 + 128 * 10 + 10
    assert report["batch_size"] == 16 and report["inputs"][0]["shape"] == [16, 32]

    acts = report["activations"]
    tanh_out = 16 * 128 * 4  # each Tanh's output is saved (by Tanh and the next Linear)
    assert acts["total_bytes"] == 2 * tanh_out
    assert {m["module"]: m["self_bytes"] for m in acts["by_module"] if m["self_bytes"]} == {
        "1": tanh_out,
        "3": tanh_out,
    }
    assert all(
        t["shape"] == [16, 128] and "TanhBackward0" in t["saved_by"]
        for t in acts["largest_tensors"]
    )

    policies = {m["label"]: m for m in report["policies"]}
    assert list(policies) == ["none", "memory"]
    assert policies["none"]["peak_ratio"] == 1.0 and policies["none"]["peak_bytes"] > 2 * tanh_out
    assert report["pareto"] and all(p["peak_bytes"] > 0 for p in report["pareto"])


def test_max_batch_fits_and_one_step_more_does_not(profiled) -> None:
    proc, out = profiled
    assert proc.returncode == 0, explain(proc)
    search = json.loads((out / "profile.json").read_text())["max_batch"]
    assert search["budget_bytes"] == BUDGET and search["batch_step"] == 32
    for result in search["results"]:
        probes = {p["batch"]: p for p in result["probes"]}
        best, over = result["max_batch"], result["first_not_fitting"]
        assert best >= 32 and over == best + 32, result
        assert probes[best]["fits"] and probes[best]["total_bytes"] <= BUDGET
        assert not probes[over]["fits"] and probes[over]["total_bytes"] > BUDGET
        assert result["total_bytes"] == probes[best]["total_bytes"]


def test_figures_are_pngs_of_sensible_size(profiled) -> None:
    proc, out = profiled
    assert proc.returncode == 0, explain(proc)
    for name in ("timeline.png", "pareto.png"):
        height, width = png_size(out / name)
        assert height > 300 and width > 500, (name, height, width)
        assert str(out / name) in proc.stdout.replace("\n", "")


def test_model_only_factory_with_input_shape(tmp_path: Path) -> None:
    proc = run_memfit(
        "profile",
        f"{FACTORIES}:tiny_mlp_model",
        "--input-shape",
        "8,32",
        "--policies",
        "none",
        "--timing-runs",
        "1",
        "--json",
        "--out",
        str(tmp_path),
    )
    assert proc.returncode == 0, explain(proc)
    report = json.loads((tmp_path / "profile.json").read_text())
    assert validate(report) == []
    assert report["inputs"] == [{"name": "args[0]", "shape": [8, 32], "dtype": "float32"}]
    assert report["activations"]["total_bytes"] == 2 * 8 * 128 * 4
    assert report["max_batch"] is None and report["pareto"] is None


def test_profile_help_has_an_example() -> None:
    proc = run_memfit("profile", "--help")
    assert proc.returncode == 0, explain(proc)
    assert "examples:" in proc.stdout and "memfit profile " in proc.stdout


def test_next_step_names_the_python_call_of_the_lowest_policy() -> None:
    from memfit.cli.profile import _next_step
    from memfit.cli.steps import PolicyResult
    from memfit.planning.plan import Plan
    from memfit.planning.policy import Policy

    def result(name: str, peak: int) -> PolicyResult:
        return PolicyResult(
            policy=Policy(name),
            peak_bytes=peak,
            plan=Plan(name),
            step_times=[],
            compile_s=0.0,
            timeline=[],
            forward_end=0.5,
            measured_s=1.0,
        )

    results = [
        result("none", 100 * 2**20),
        result("speed", 60 * 2**20),
        result("memory", 40 * 2**20),
    ]
    assert "memfit.checkpoint(model, 'memory')" in _next_step(results, searched=True)
    # measured with --executor inductor: the call runs the plan that was measured
    inductor = _next_step(results, searched=True, executor="inductor")
    assert "memfit.checkpoint(model, 'memory', executor='inductor')" in inductor
    assert "--budget" in _next_step(results, searched=False)
    assert "small part" in _next_step([results[0], result("memory", 95 * 2**20)], True)
    assert "--policies" in _next_step(results[:1], True)


def test_offload_rows_and_report(tmp_path: Path) -> None:
    offload_dir = tmp_path / "offload"
    offload_dir.mkdir()
    proc = run_memfit(
        "profile",
        f"{FACTORIES}:tiny_mlp",
        "--policies",
        "memory",
        "--offload",
        "--offload-dir",
        str(offload_dir),
        "--timing-runs",
        "1",
        "--json",
        "--out",
        str(tmp_path / "out"),
    )
    assert proc.returncode == 0, explain(proc)
    report = json.loads((tmp_path / "out" / "profile.json").read_text())
    assert validate(report) == []
    labels = [p["label"] for p in report["policies"]]
    assert labels == ["none", "memory", "memory + offload", "swap"]
    for entry in report["policies"]:
        assert entry["offloaded_bytes"] >= 0 and entry["stall_seconds"] >= 0
    assert list(offload_dir.iterdir()) == []  # the private directory went with its wrapper


def test_bad_offload_dir_is_a_cli_error(tmp_path: Path) -> None:
    proc = run_memfit(
        "profile", f"{FACTORIES}:tiny_mlp", "--offload", "--offload-dir", str(tmp_path / "nope")
    )
    assert proc.returncode != 0
    assert "does not exist" in proc.stderr + proc.stdout


def test_autotune_without_inductor_is_a_cli_error() -> None:
    proc = run_memfit("profile", f"{FACTORIES}:tiny_mlp", "--policies", "0.5", "--autotune")
    assert proc.returncode != 0
    assert "--executor inductor" in proc.stderr + proc.stdout
