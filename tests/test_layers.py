"""The layering written in each folder's README holds in the code: no module imports upwards.

``nn`` (kernels and modules users may call directly) sits at the bottom (torch, ``memfit._compat``,
``memfit.units`` and ``memfit.warn`` only), then capture (whose attention pass rewrites into
``nn``'s kernels) and measurement, then analysis, planning, execution and ``pipeline``, each
importing only layers below it; the CLI, the benchmarks and the package root may import
anything. Only ``memfit._compat`` imports torch's private modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import memfit

SRC = Path(memfit.__file__).resolve().parent

#: Layer of each folder; a module may import its own folder and folders of a lower layer.
LAYERS = {
    "_compat": 0,
    "units": 0,
    "warn": 0,
    "nn": 1,
    "capture": 2,
    "measurement": 2,
    "analysis": 3,
    "planning": 4,
    "execution": 5,
    "pipeline": 6,
}
PRIVATE = ("torch._", "torch.utils._", "functorch")


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
    return names


def _layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "memfit" and len(parts) > 1 and parts[1] in LAYERS else None


def test_no_layer_imports_a_layer_above_it() -> None:
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        own = rel.parts[0].removesuffix(".py")
        if own not in LAYERS:
            continue  # __init__, cli, bench: the top
        for name in _imports(path):
            other = _layer_of(name)
            if other is not None and other != own and LAYERS[other] >= LAYERS[own]:
                bad.append(f"{rel} imports {name}")
            if name.startswith("memfit") and other is None and name != "memfit":
                bad.append(f"{rel} imports {name} (CLI, bench or the package root)")
    assert not bad, "\n".join(bad)


def test_only_compat_imports_private_torch() -> None:
    bad = [
        f"{path.relative_to(SRC)} imports {name}"
        for path in sorted(SRC.rglob("*.py"))
        if path.parent.name != "_compat"
        for name in _imports(path)
        if name.startswith(PRIVATE)
    ]
    assert not bad, "\n".join(bad)


def test_every_layer_has_a_readme() -> None:
    for folder in ("nn", "capture", "analysis", "planning", "execution", "measurement", "pipeline"):
        assert (SRC / folder / "README.md").is_file(), folder
