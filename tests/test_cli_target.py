"""Loading ``TARGET``: files and modules, dotted attributes, what a factory may return."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

from memfit.cli.errors import CliError
from memfit.cli.target import build_target, load_factory, move_inputs


def write(path: Path, source: str) -> Path:
    path.write_text(textwrap.dedent(source))
    return path


def test_file_target_imports_its_neighbours(tmp_path: Path) -> None:
    write(tmp_path / "helper.py", "WIDTH = 7\n")
    f = write(
        tmp_path / "model file.py",
        """\
        import torch
        from helper import WIDTH

        class Factories:
            @staticmethod
            def build():
                return torch.nn.Linear(WIDTH, 2), {"input": torch.ones(3, WIDTH)}
        """,
    )
    target = build_target(f"{f}:Factories.build")
    assert target.model.in_features == 7
    assert target.args == () and target.kwargs["input"].shape == (3, 7)


def test_module_target_and_return_forms(tmp_path: Path, monkeypatch) -> None:
    write(
        tmp_path / "my_models.py",
        """\
        import torch
        def as_tensor(): return torch.nn.Linear(4, 2), torch.ones(2, 4)
        def as_tuple(): return (torch.nn.Bilinear(4, 4, 2), (torch.ones(2, 4), torch.ones(2, 4)))
        def model_only(): return torch.nn.Linear(4, 2)
        def wrong(): return 42
        def wrong_inputs(): return torch.nn.Linear(4, 2), 42
        """,
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert len(build_target("my_models:as_tensor").args) == 1
    assert len(build_target("my_models:as_tuple").args) == 2
    shaped = build_target("my_models:model_only", [(5, 4), (2,)])
    assert [tuple(a.shape) for a in shaped.args] == [(5, 4), (2,)]
    with pytest.raises(CliError, match=r"must return \(model, example_inputs\), got int"):
        build_target("my_models:wrong")
    with pytest.raises(CliError, match="example_inputs must be a tensor"):
        build_target("my_models:wrong_inputs")
    with pytest.raises(CliError, match="must return the model"):
        build_target("my_models:as_tensor", [(2, 4)])
    sys.modules.pop("my_models", None)


def test_errors_name_the_target(tmp_path: Path) -> None:
    f = write(tmp_path / "broken.py", "raise ImportError('cannot import thing')\n")
    with pytest.raises(CliError, match="broken.py: running it raised ImportError: cannot import"):
        load_factory(f"{f}:make")
    with pytest.raises(CliError, match="is a directory"):
        load_factory(f"{tmp_path}/:make")
    with pytest.raises(CliError, match="names no factory"):
        load_factory("justamodule")


def test_move_inputs_casts_only_floating_tensors() -> None:
    x, ids = torch.ones(2, dtype=torch.float32), torch.arange(3)
    moved = move_inputs(((x, ids), {"k": x}), torch.device("cpu"), torch.float64)
    assert moved[0][0].dtype == torch.float64 and moved[0][1].dtype == torch.int64
    assert moved[1]["k"].dtype == torch.float64
