"""``memfit pipeline``: the plan printed, bad input refused in one line, ``--run`` measured."""

from __future__ import annotations

import pytest

from clitools import run_memfit
from memfit.cli import build_parser, main
from memfit.cli.pipeline import pipeline_options
from memfit.pipeline import PipelineOptions

FACTORY = "tests/cli_factories.py:tiny_mlp"


def test_the_plan_is_printed_without_running_anything() -> None:
    done = run_memfit("pipeline", FACTORY, "--ranks", "2", "--microbatches", "4")
    assert done.returncode == 0, done.stderr
    assert "2 stages, 4 micro-batches, gpipe" in done.stdout
    assert "bubble" in done.stdout and "measured" not in done.stdout


def test_arguments_no_pipeline_can_honour_are_refused_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for args, message in (
        (("--ranks", "50", "--microbatches", "4"), "candidate cuts"),
        (("--ranks", "2", "--microbatches", "4", "--budget", "1KiB"), "smallest per-device"),
        (("--ranks", "3", "--microbatches", "2", "--schedule", "1f1b"), "1F1B needs"),
        (("--ranks", "2"), "--microbatches is required unless --schedule auto"),
        (("--ranks", "2", "--schedule", "auto", "--stages-per-rank", "0"), "must be at least 1"),
        (("--ranks", "2", "--schedule", "auto", "--budget", "1KiB"), "least reachable"),
    ):
        assert main(["pipeline", FACTORY, *args]) == 2, args
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err


def test_the_flags_build_the_options_plan_and_pipeline_take() -> None:
    """A flag not given is ``PipelineOptions``' default; milliseconds become seconds."""
    parse = build_parser().parse_args
    bare = parse(["pipeline", FACTORY, "--ranks", "2", "--microbatches", "4"])
    assert pipeline_options(bare) == PipelineOptions(microbatches=4)
    given = parse(
        ["pipeline", FACTORY, "--ranks", "2", "--schedule", "auto", "--offload"]
        + ["--budget", "1MiB", "--overhead-ms", "2", "--optimizer-state", "2"]
    )
    assert pipeline_options(given) == PipelineOptions(
        schedule="auto", offload=True, budget="1MiB", overhead=0.002, optimizer_state=2.0
    )


def test_the_deprecated_stages_flag_still_plans_and_says_the_new_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["pipeline", FACTORY, "--stages", "2", "--microbatches", "4"]) == 0
    done = capsys.readouterr()
    assert "write --ranks 2" in done.err and "2 stages, 4 micro-batches" in done.out
    assert main(["pipeline", FACTORY, "--microbatches", "4"]) == 2
    assert "--ranks K is required" in capsys.readouterr().err


def test_auto_prints_the_candidates_and_its_choice(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pipeline", FACTORY, "--ranks", "2", "--schedule", "auto"]) == 0
    out = capsys.readouterr().out
    assert "schedule='auto' compared" in out and "dualpipev" in out and "\n* " in out


def test_run_trains_in_k_processes_and_sets_measured_beside_predicted() -> None:
    """Under ``auto`` (its choice among two stages per rank is what the ranks run)."""
    done = run_memfit(
        "pipeline",
        FACTORY,
        "--ranks",
        "2",
        "--microbatches",
        "4",
        "--schedule",
        "auto",
        "--stages-per-rank",
        "2",
        "--run",
        "--steps",
        "2",
    )
    assert done.returncode == 0, done.stderr
    assert "predicted peak" in done.stdout and "measured peak" in done.stdout
    assert "step: measured" in done.stdout and "(2 per rank on 2 ranks)" in done.stdout
