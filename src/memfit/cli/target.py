"""``TARGET`` of ``memfit profile``: where the user's model comes from.

A target names a *factory*, a function that takes no arguments and builds the model, the way a user
already has one for training::

    path/to/file.py:make_model        a file, loaded as a script would be (its folder on sys.path)
    package.module:make_model         an importable module (the current directory on sys.path)
    package.module:Class.method       dotted attributes are followed

The factory returns ``(model, example_inputs)``, where ``example_inputs`` is one tensor, a tuple or
list of positional arguments, or a dict of keyword arguments; or just the model when the command
line gives ``--input-shape`` (random normal inputs of that shape are made). Each way this can go
wrong (no file, no module, no attribute, a factory that raises or returns something else) is a
:class:`~memfit.cli.errors.CliError` naming the target; with ``--debug`` the factory's own
traceback is shown.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memfit._compat import tree_map
from memfit.cli.errors import CliError, first_line

__all__ = ["Target", "load_factory", "build_target", "move_inputs"]

_FORMS = "path/to/file.py:factory or package.module:factory"


@dataclass
class Target:
    """The user's model and the inputs of one step, as the factory returned them."""

    spec: str
    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def _split(spec: str) -> tuple[str, str]:
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise CliError(f"TARGET {spec!r} names no factory; write {_FORMS}")
    return where, attr


def _is_path(where: str) -> bool:
    return where.endswith(".py") or os.sep in where or "/" in where


def _load_file(path_text: str) -> Any:
    path = Path(path_text).expanduser()
    if not path.is_file():
        kind = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise CliError(f"{path_text}: {kind}; TARGET is {_FORMS}")
    name = "memfit_target_" + "".join(c if c.isalnum() else "_" for c in path.stem)
    spec = importlib.util.spec_from_file_location(name, path.resolve())
    if spec is None or spec.loader is None:
        raise CliError(f"{path_text}: cannot be loaded as Python source")
    module = importlib.util.module_from_spec(spec)
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # as `python file.py` would: its neighbours are importable
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        raise CliError(f"{path_text}: running it raised {first_line(err)}") from err
    return module


def _load_module(name: str) -> Any:
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` would
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name and (name == err.name or name.startswith(err.name + ".")):
            raise CliError(
                f"no module named {err.name!r} (from TARGET {name}:...); is it "
                f"installed or under the current directory? TARGET is {_FORMS}"
            ) from err
        raise CliError(f"importing {name} raised {first_line(err)}") from err
    except Exception as err:
        raise CliError(f"importing {name} raised {first_line(err)}") from err


def load_factory(spec: str) -> Callable[[], Any]:
    """The callable ``spec`` names (see the module docstring)."""
    where, attr = _split(spec)
    obj = _load_file(where) if _is_path(where) else _load_module(where)
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            owner = where if i == 0 else f"{where}:{'.'.join(attr.split('.')[:i])}"
            names = [
                n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None))
            ]
            close = difflib.get_close_matches(part, names, n=3)
            hint = (
                f"; did you mean {', '.join(close)}?"
                if close
                else f"; callables there: {', '.join(names[:8])}"
                if names
                else ""
            )
            raise CliError(f"{owner} has no attribute {part!r}{hint}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise CliError(
            f"{spec}: {attr} is a {type(obj).__name__}, not a function that builds the model"
        )
    return obj


def build_target(spec: str, input_shapes: Sequence[tuple[int, ...]] = ()) -> Target:
    """Call the factory and check what it returned."""
    factory = load_factory(spec)
    try:
        made = factory()
    except Exception as err:
        raise CliError(f"{spec}: the factory raised {first_line(err)}") from err
    if input_shapes:
        if not isinstance(made, nn.Module):
            raise CliError(
                f"{spec}: with --input-shape the factory must return the model (an "
                f"nn.Module), but it returned {type(made).__name__}"
            )
        return Target(spec, made, tuple(torch.randn(s) for s in input_shapes), {})
    if isinstance(made, nn.Module):
        raise CliError(
            f"{spec}: the factory returned only a model; return (model, example_inputs)"
            " or give --input-shape, e.g. --input-shape 8,3,32,32"
        )
    if not (isinstance(made, (tuple, list)) and len(made) == 2 and isinstance(made[0], nn.Module)):
        raise CliError(
            f"{spec}: the factory must return (model, example_inputs), got {type(made).__name__}"
        )
    model, inputs = made
    if isinstance(inputs, torch.Tensor):
        return Target(spec, model, (inputs,), {})
    if isinstance(inputs, Mapping):
        return Target(spec, model, (), dict(inputs))
    if isinstance(inputs, (tuple, list)):
        return Target(spec, model, tuple(inputs), {})
    raise CliError(
        f"{spec}: example_inputs must be a tensor, a tuple or list of arguments, or a "
        f"dict of keyword arguments, got {type(inputs).__name__}"
    )


def move_inputs(value: Any, device: torch.device, dtype: torch.dtype | None) -> Any:
    """Tensors in ``value`` moved to ``device``; floating ones cast to ``dtype`` if given."""

    def move(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if dtype is not None and t.is_floating_point():
            return t.to(device=device, dtype=dtype)
        return t.to(device)

    return tree_map(move, value)
