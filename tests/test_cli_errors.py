"""Every bad input gives one line naming the problem, exit status 2, and no traceback.

The inputs the issue lists (a missing file, a missing attribute, a factory that raises, an
unparsable budget, a budget smaller than the model's parameters, a device that does not exist) are
each run as a real ``memfit`` subprocess, all started at once so they share the torch import time;
``--debug`` must add the traceback. The other checks call ``memfit.cli.main`` in-process.
One more subprocess checks that the script restarts itself under ``OMP_WAIT_POLICY=PASSIVE``.
"""

from __future__ import annotations

import subprocess

import pytest

from clitools import explain, start_memfit
from memfit.cli import main

FACTORIES = "tests/cli_factories.py"

# name: (arguments, a fragment the error line must contain)
SUBPROCESS_CASES = {
    "missing file": (["profile", "no/such/file.py:make"], "no/such/file.py: does not exist"),
    "missing attribute": (
        ["profile", f"{FACTORIES}:tiny_mpl"],
        "has no attribute 'tiny_mpl'; did you mean tiny_mlp",
    ),
    "factory raises": (
        ["profile", f"{FACTORIES}:raises"],
        "the factory raised RuntimeError: factory failed on purpose",
    ),
    "unparsable budget": (
        ["profile", f"{FACTORIES}:tiny_mlp", "--budget", "1.5 gigs"],
        "cannot parse budget '1.5 gigs'",
    ),
    "budget below parameters": (
        ["profile", f"{FACTORIES}:tiny_mlp", "--budget", "4KiB"],
        "is smaller than the model's parameters and buffers",
    ),
    "device that does not exist": (
        ["profile", f"{FACTORIES}:tiny_mlp", "--device", "cuda:99"],
        "--device 'cuda:99' does not exist",
    ),
}


@pytest.fixture(scope="module")
def finished() -> dict[str, subprocess.CompletedProcess]:
    """Run every case (and the --debug one) concurrently; their outputs by name."""
    cases = {name: args for name, (args, _) in SUBPROCESS_CASES.items()}
    cases["--debug"] = ["profile", f"{FACTORIES}:raises", "--debug"]
    procs = {name: (args, start_memfit(*args)) for name, args in cases.items()}
    args = ["profile", f"{FACTORIES}:raises_with_omp_policy"]
    procs["no OMP_WAIT_POLICY"] = (args, start_memfit(*args, unset=("OMP_WAIT_POLICY",)))
    out = {}
    for name, (args, proc) in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        out[name] = subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)
    return out


@pytest.mark.parametrize("name", list(SUBPROCESS_CASES))
def test_bad_input_is_one_line_and_exit_2(name: str, finished: dict) -> None:
    proc = finished[name]
    fragment = SUBPROCESS_CASES[name][1]
    assert proc.returncode == 2, explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memfit: error: "), explain(proc)
    assert fragment in lines[0], explain(proc)


def test_debug_shows_the_traceback_of_the_factory(finished: dict) -> None:
    proc = finished["--debug"]
    assert proc.returncode == 2, explain(proc)
    assert (
        "Traceback" in proc.stderr
        and 'raise RuntimeError("factory failed on purpose")' in proc.stderr
    ), explain(proc)
    assert proc.stderr.strip().splitlines()[-1].startswith("memfit: error: ")


def test_the_script_restarts_itself_with_passive_openmp(finished: dict) -> None:
    proc = finished["no OMP_WAIT_POLICY"]  # the factory reports the policy in its error
    assert proc.returncode == 2, explain(proc)
    assert proc.stderr.strip().splitlines() == [
        "memfit: error: tests/cli_factories.py:raises_with_omp_policy: the factory raised "
        "RuntimeError: OMP_WAIT_POLICY=PASSIVE"
    ], explain(proc)


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["profile", "tests.cli_factories:nothing_here"], "has no attribute 'nothing_here'"),
        (["profile", "no_such_package.models:make"], "no module named 'no_such_package'"),
        (["profile", f"{FACTORIES}:NOT_CALLABLE"], "is a int, not a function"),
        (["profile", f"{FACTORIES}"], "names no factory"),
        (["profile", f"{FACTORIES}:tiny_mlp_model"], "returned only a model"),
        (["profile", f"{FACTORIES}:tiny_mlp", "--budget", "0.5"], "is a fraction"),
        (["profile", f"{FACTORIES}:tiny_mlp", "--budget=-3MB"], "cannot parse budget"),
        (["profile", f"{FACTORIES}:tiny_mlp", "--device", "tpu"], "--device 'tpu'"),
        (["profile", f"{FACTORIES}:tiny_mlp", "--dtype", "int8"], "--dtype 'int8'"),
        (["profile", f"{FACTORIES}:tiny_mlp", "--policies", "none,fast"], "'fast' is not a policy"),
        (["profile", f"{FACTORIES}:tiny_mlp", "--policies", "2lots"], "cannot parse budget"),
        (["profile", f"{FACTORIES}:tiny_mlp_model", "--input-shape", "16,x"], "is not a shape"),
        (["profile", f"{FACTORIES}:tiny_mlp", "--batch-step", "0"], "--batch-step 0"),
        (
            ["profile", f"{FACTORIES}:tiny_mlp", "--budget", "1GiB", "--batch-dim", "2"],
            "--batch-dim 2: no example input has a dimension 2",
        ),
        (["bench", "depth-sweep", "--device", "cuda:99"], "does not exist"),
        (["bench", "depth-sweep", "--depths", "0"], "--depths 0: must be at least 1"),
    ],
)
def test_bad_input_in_process(argv: list[str], fragment: str, capsys, monkeypatch) -> None:
    from clitools import ROOT

    monkeypatch.chdir(ROOT)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("memfit: error: ") and fragment in err[0], err


def test_usage_errors_exit_2(capsys) -> None:
    assert main(["profile"]) == 2  # argparse: TARGET missing
    assert main(["frobnicate"]) == 2
    assert main(["profile", "tests.cli_factories:tiny_mlp", "--executor", "tvm"]) == 2
    assert main(["--help"]) == 0
    assert "examples:" in capsys.readouterr().out
