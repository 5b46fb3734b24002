"""Shared test set-up: every test starts with Dynamo's caches empty.

Dynamo keeps compiled code per code object across the whole process, with a limit on how many
versions it keeps; tests wrap many models of the same classes in many modes, so without a reset
a later test could silently run an earlier test's graphs or hit the recompile limit.

Run by ``pytest -n N`` (pytest-xdist, as ``make test`` does), each of the N worker processes
gets its share of the machine's cores for torch's threads, so the workers do not contend for them.

``split_graphs`` records the forward and backward graphs memfit's backend makes of each plan;
``backward_donations`` the donated inputs of each backward graph Inductor compiles.
"""

import os
from typing import Any, NamedTuple

import pytest
import torch
import torch.fx as fx


def conv_bn_net() -> torch.nn.Module:
    """Two seeded Conv-BatchNorm-ReLU layers and a Linear head, for inputs of 2x3x8x8: the
    smallest model with training BatchNorms between convolutions."""
    nn = torch.nn
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 4),
    )


#: Marks a test (or a ``pytest.param``) that needs a GPU: skipped where CUDA is not available.
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch.compiler.reset()


# ---- the fast tier: `make test-fast` runs what is not marked slow (`make test` runs everything)
#: Where a test runs over many models, these three stay in the fast tier: a chain of linears, a
#: ResNet with BatchNorm, a transformer encoder (attention).
CORE_MODELS = ("mlp", "resnet", "transformer")
#: Models a parametrized test names in its id that only the full suite runs.
_SLOW_MODELS = {
    "unet", "lstm", "densenet", "dropout", "inplace_relu", "shared", "structured", "gpt2",
    "resnet110", "bert", "llama", "t5",
}  # fmt: skip
#: Whole files the fast tier leaves out: subprocesses and several ranks (the command line,
#: pipelines, import order), Inductor compiles and passes, every zoo model under budgets, the
#: frameworks, the benchmarks' runner.
_SLOW_FILES = {
    "test_budget_zoo.py", "test_executors.py", "test_fusion.py", "test_examples.py",
    "test_pipeline_runtime.py", "test_launch.py", "test_ddp.py", "test_huggingface.py",
    "test_benchmarks_depth_sweep.py", "test_cli_profile.py", "test_cli_errors.py",
    "test_cli_out.py", "test_cli_demo.py", "test_cli_pipeline.py", "test_cli_bench.py",
    "test_cli_batch_search.py", "test_passes.py", "test_runner.py",
}  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark slow: the files above, a parametrized case that names a model outside the core trio,
    and a test of the Inductor executor (tests marked ``slow`` by hand are the rest: the slowest
    single tests, 2-12 s each on 2 cores)."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        ids = set(callspec.id.split("-")) if callspec is not None else set()
        inductor = "inductor" in ids or "inductor" in getattr(item, "originalname", item.name)
        if item.path.name in _SLOW_FILES or ids & _SLOW_MODELS or inductor:
            item.add_marker(pytest.mark.slow)


class Split(NamedTuple):
    """One call of ``split_joint_graph`` made by memfit's backend: what went in, what came out."""

    joint: fx.GraphModule
    plan: Any
    kwargs: dict[str, Any]
    fw: fx.GraphModule
    bw: fx.GraphModule


@pytest.fixture
def split_graphs(monkeypatch: pytest.MonkeyPatch) -> list[Split]:
    """Every forward and backward graph memfit's backend splits a joint graph into during the
    test, in order, with the plan it followed."""
    from memfit.execution import partitioner

    seen: list[Split] = []
    original = partitioner.split_joint_graph

    def spy(joint: fx.GraphModule, plan: Any, **kwargs: Any) -> tuple[fx.GraphModule, ...]:
        fw, bw = original(joint, plan, **kwargs)
        seen.append(Split(joint, plan, kwargs, fw, bw))
        return fw, bw

    monkeypatch.setattr(partitioner, "split_joint_graph", spy)
    return seen


@pytest.fixture
def backward_donations(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The positions given to Inductor as donated for each backward graph it compiles for memfit
    during the test, in order."""
    from memfit.execution import executors

    donated: list[list[int]] = []
    original = executors.inductor_compile

    def spy(gm: fx.GraphModule, examples: Any, **kwargs: Any) -> Any:
        if kwargs["is_backward"]:
            donated.append(list(kwargs["donated_inputs"]))
        return original(gm, examples, **kwargs)

    monkeypatch.setattr(executors, "inductor_compile", spy)
    return donated
