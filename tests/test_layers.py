"""The layering written in each folder's README holds in the code: no module imports upwards.

``nn`` (kernels and modules users may call directly) sits at the bottom (torch, ``memfit._compat``,
``memfit.units``, ``memfit.warn`` and ``memfit.choice`` only), then capture (whose attention pass
rewrites into ``nn``'s kernels) and measurement, then analysis, planning, execution, and
``pipeline`` and ``fitting`` beside each other, each importing only layers below it; the CLI, the
benchmarks and the package root may import anything. Only ``memfit._compat`` reaches torch's
private API: it alone imports torch's private modules and reads private torch attributes (NOTE
[Private torch names] says what counts). Tests and benchmarks may reach them; the check covers
``src/memfit``.
No two modules import each other, directly or around a loop, counting imports inside functions
and under ``TYPE_CHECKING`` (``import_graph`` says how an import statement is read).
"""

from __future__ import annotations

import ast
import textwrap
from itertools import pairwise
from pathlib import Path

import memfit

SRC = Path(memfit.__file__).resolve().parent

#: Layer of each folder; a module may import its own folder and folders of a lower layer.
LAYERS = {
    "_compat": 0,
    "units": 0,
    "warn": 0,
    "choice": 0,
    "nn": 1,
    "capture": 2,
    "measurement": 2,
    "analysis": 3,
    "planning": 4,
    "execution": 5,
    "pipeline": 6,
    "fitting": 6,
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
    for folder in (
        "nn", "capture", "analysis", "planning", "execution", "measurement", "pipeline", "fitting"
    ):  # fmt: skip
        assert (SRC / folder / "README.md").is_file(), folder


def _module_name(path: Path, root: Path) -> str:
    """``memfit.analysis.graph`` for ``.../memfit/analysis/graph.py``; a package's ``__init__.py``
    is the package (``memfit.analysis``)."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path = SRC) -> dict[str, dict[str, int]]:
    """Each memfit module's imports of other memfit modules: ``{module: {imported: line}}``.

    Every import statement counts, wherever it is: at the top, inside a function, under
    ``if TYPE_CHECKING``; an import moved inside a function still makes the two modules depend
    on each other, it only hides the loop until the function runs. The edge of each statement:

    * ``import memfit.a.b`` depends on ``memfit.a.b``, the module it names, not on
      ``memfit.a``'s ``__init__`` that Python runs first. Counting the parents would make every
      module depend on ``memfit/__init__.py``, which imports the public API from every layer, and
      so put every module in one loop that says nothing about the code.
    * ``from memfit.a import b`` depends on ``memfit.a.b`` where that is a module, else on
      ``memfit.a`` (the module, or the package whose ``__init__`` defines or re-exports ``b``).
    * A package's ``__init__`` imports are edges from the package: importing a name from a
      package depends on every module its ``__init__`` imports.
    """
    modules = {_module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [
                    f"{node.module}.{alias.name}"
                    if f"{node.module}.{alias.name}" in modules
                    else node.module
                    for alias in node.names
                ]
            else:
                continue
            for target in targets:
                if target in modules and target != name:
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[tuple[list[str], list[str]]]:
    """Each set of two or more modules that import one another, in or out of functions (a
    strongly connected component), sorted, with the shortest cycle through its first module, in
    import order, that module repeated at the end (``[a, b, a]``)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm; memfit's imports are a few levels deep
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    found = []
    for component in components:
        # The shortest way from the component's first module back to itself, breadth first.
        start = min(component)
        before: dict[str, str] = {}  # each module reached: the module it was reached from
        layer = [start]
        while start not in before:
            reached = []
            for v in layer:
                for w in sorted(graph[v]):
                    if w in component and w not in before:
                        before[w] = v
                        reached.append(w)
            layer = reached
        path = [start]
        while path[-1] != start or len(path) == 1:
            path.append(before[path[-1]])
        found.append((sorted(component), path[::-1]))
    return [(cycle, component) for component, cycle in sorted(found)]


def test_no_import_cycles() -> None:
    graph = import_graph()
    assert "memfit.analysis.graph" in graph["memfit.analysis.backward_start"], "graph not read"
    bad = [
        " -> ".join(f"{module} line {graph[module][next_]}" for module, next_ in pairwise(cycle))
        + f" -> {cycle[-1]} (all in one loop: {', '.join(component)})"
        for cycle, component in find_cycles(graph)
    ]
    assert not bad, (
        "import cycles, counting imports inside functions (move what both modules need into "
        "one they import, or into a small module of its own):\n" + "\n".join(bad)
    )


def test_the_cycle_check_finds_a_loop_hidden_in_a_function() -> None:
    graph = {"a": {"b": 1}, "b": {"c": 3}, "c": {"a": 9, "b": 5, "d": 2}, "d": {}, "e": {"d": 1}}
    assert find_cycles(graph) == [(["a", "b", "c", "a"], ["a", "b", "c"])]
    assert find_cycles({"a": {"b": 1}, "b": {}}) == []


def test_the_import_graph_counts_every_import_by_its_rules(tmp_path: Path) -> None:
    files = {
        "__init__.py": "from memfit.a import api\n",
        "a/__init__.py": "from memfit.a.api import api\n",
        "a/api.py": "def api():\n    from memfit.b import helper\n    import memfit.c.deep\n",
        "b.py": "from memfit.a import api\nfrom memfit.c import deep, NAME\nimport torch\n",
        "c/__init__.py": "NAME = 1\n",
        "c/deep.py": "if TYPE_CHECKING:\n    from memfit.a.api import api\n",
    }
    for name, text in files.items():
        (tmp_path / "memfit" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "memfit" / name).write_text(text)
    graph = import_graph(tmp_path / "memfit")
    assert graph == {
        "memfit": {"memfit.a.api": 1},
        "memfit.a": {"memfit.a.api": 1},
        "memfit.a.api": {"memfit.b": 2, "memfit.c.deep": 3},
        "memfit.b": {"memfit.a.api": 1, "memfit.c.deep": 2, "memfit.c": 2},
        "memfit.c": {},
        "memfit.c.deep": {"memfit.a.api": 2},
    }
    assert [cycle for cycle, _ in find_cycles(graph)] == [
        ["memfit.a.api", "memfit.b", "memfit.a.api"]
    ]


# NOTE [Private torch names]
# Outside ``_compat`` no expression may reach a private torch name: one that starts with a single
# underscore (dunders such as ``torch.__version__`` are public). Read from the AST, a name is
# reached
#  1. at the end of a chain rooted at torch: ``torch._dynamo.config``, ``torch._C._foo``,
#     ``F._canonical_mask`` after ``import torch.nn.functional as F``, ``Node._x`` after
#     ``from torch.fx import Node``, ``from torch import _C``. Calls and subscripts continue a
#     chain (``torch.nn.Module()._modules``); ``getattr``, ``hasattr``, ``setattr`` and
#     ``delattr`` with a literal name extend it as a dot does; a name assigned such a chain
#     anywhere in the file (``owner = nn.Module()``) counts as one everywhere in the file;
#  2. by ``getattr`` and its kin with a literal name, on a value the AST cannot trace (an FX
#     node's target): memfit has no reason to reach its own private names by string, so the
#     owner is taken to be torch. Values of ``self``, ``cls`` and of names imported from outside
#     torch (``sys._getframe``) are not torch's;
#  3. as one of TORCH_PRIVATE_ATTRIBUTES, on any value the AST cannot trace
#     (``node.target._schema``), except values of names imported from outside torch.
# Op names are not private Python API: ATen names its internal ops with an underscore and they are
# called by name like any other. Under ``torch.ops`` the namespace and the op may start with one
# (``torch.ops.aten._softmax.default``, ``torch.ops._c10d_functional``); the overload and what
# follows it are attributes of torch's op objects and follow the rule
# (``torch.ops.aten.mm.default._schema``). Not seen: other private attributes of values whose
# torch type only shows at run time (``node.target._opname``), and string annotations.

_GETATTRS = frozenset({"getattr", "hasattr", "setattr", "delattr"})

#: Private attributes of torch objects that reach memfit as values the AST cannot trace to torch
#: (rule 3 of NOTE [Private torch names]), each with what it is.
TORCH_PRIVATE_ATTRIBUTES = {
    "_schema": "an ATen op's schema (OpOverload)",
    "_boxed_call": "AOTAutograd's mark of a compiled function that takes one list of inputs",
    "_modules": "an nn.Module's children",
    "_parameters": "an nn.Module's own parameters",
    "_buffers": "an nn.Module's own buffers",
    "_backward_hooks": "the hooks of a tensor or module",
    "_post_accumulate_grad_hooks": "the hooks a leaf tensor runs after its .grad is added to",
}

TorchPath = tuple[str, ...]


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_at_end(path: TorchPath) -> bool:
    """Whether the last name of a path from ``torch`` is private (op names are not)."""
    is_op_name = path[:2] == ("torch", "ops") and len(path) in (3, 4)
    return _is_private(path[-1]) and not is_op_name


def _literal_getattr(node: ast.AST) -> tuple[ast.expr, str] | None:
    """``(value, name)`` of ``getattr(value, "name", ...)`` and its kin; None for anything else."""
    if not (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _GETATTRS
        and len(node.args) >= 2
    ):
        return None
    name = node.args[1]
    if isinstance(name, ast.Constant) and isinstance(name.value, str):
        return node.args[0], name.value
    return None


def _torch_path(node: ast.AST, torch_names: dict[str, TorchPath]) -> TorchPath | None:
    """The path from ``torch`` an expression reaches (``()`` for a call, ``[]`` for a subscript),
    or None where it does not start at a name bound to torch."""
    if isinstance(node, ast.Name):
        return torch_names.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _torch_path(node.value, torch_names)
        return None if base is None else (*base, node.attr)
    if isinstance(node, ast.Call):
        by_name = _literal_getattr(node)
        if by_name is not None:
            base = _torch_path(by_name[0], torch_names)
            return None if base is None else (*base, by_name[1])
        base = _torch_path(node.func, torch_names)
        return None if base is None else (*base, "()")
    if isinstance(node, ast.Subscript):
        base = _torch_path(node.value, torch_names)
        return None if base is None else (*base, "[]")
    return None


def _root(node: ast.AST) -> str | None:
    """The name an attribute chain starts at (``node`` in ``node.target.x``), or None."""
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _bindings(tree: ast.AST) -> tuple[dict[str, TorchPath], set[str]]:
    """The names bound to torch paths (imports, then assignments of torch chains) and the names
    imported from anywhere else."""
    torch_names: dict[str, TorchPath] = {}
    foreign: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = tuple(alias.name.split("."))
                bound = alias.asname or parts[0]
                if parts[0] == "torch":
                    torch_names[bound] = parts if alias.asname else parts[:1]
                else:
                    foreign.add(bound)
        elif isinstance(node, ast.ImportFrom):
            module = tuple(node.module.split(".")) if node.module and node.level == 0 else ()
            for alias in node.names:
                if module[:1] == ("torch",):
                    torch_names[alias.asname or alias.name] = (*module, alias.name)
                else:
                    foreign.add(alias.asname or alias.name)
    assigned = [
        (target.id, node.value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Name)
    ]
    changed = True
    while changed:  # ``b = a`` after ``a = torch.fx``: until no name is added
        changed = False
        for name, value in assigned:
            path = _torch_path(value, torch_names)
            if path is not None and name not in torch_names and name not in foreign:
                torch_names[name] = path
                changed = True
    return torch_names, foreign


def _chain(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> ast.AST:
    """The longest attribute chain ``node`` starts (``torch._functorch.config.donated_buffer``
    for ``torch._functorch``), to name in a message."""
    parent = parents.get(node)
    while isinstance(parent, ast.Attribute) and parent.value is node:
        node, parent = parent, parents.get(parent)
    return node


def private_torch_names(source: str) -> list[tuple[int, str]]:
    """``(line, expression)`` of each private torch name ``source`` reaches, in line order
    (NOTE [Private torch names])."""
    tree = ast.parse(source)
    torch_names, foreign = _bindings(tree)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            module = tuple(node.module.split("."))
            found.extend(
                (node.lineno, f"from {node.module} import {alias.name}")
                for alias in node.names
                if module[0] == "torch" and _private_at_end((*module, alias.name))
            )
            continue
        by_name = _literal_getattr(node)
        if by_name is not None:
            value, name = by_name
        elif isinstance(node, ast.Attribute):
            value, name = node.value, node.attr
        else:
            continue
        if not _is_private(name):
            continue
        path = _torch_path(value, torch_names)
        root = _root(value)
        if path is not None:
            private = _private_at_end((*path, name))
        elif root in foreign:
            private = False
        else:
            private = name in TORCH_PRIVATE_ATTRIBUTES or (
                by_name is not None and root not in ("self", "cls")
            )
        if private:
            found.append((node.lineno, ast.unparse(_chain(node, parents))))
    return sorted(set(found))  # ``torch._C._foo`` reaches two


def test_only_compat_reaches_private_torch_names() -> None:
    found: dict[tuple[str, str], list[int]] = {}
    checked = 0
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        if rel.parts[0] == "_compat":
            continue
        checked += 1
        for line, expression in private_torch_names(path.read_text()):
            found.setdefault((rel.as_posix(), expression), []).append(line)
    bad = [
        f"src/memfit/{file}:{line}: {expression} reaches a private torch name; move it into "
        f"memfit/_compat/ as a named entry (with the torch versions it was checked on) and use that"
        for (file, expression), lines in sorted(found.items())
        for line in lines
    ]
    assert checked > 50, f"only {checked} modules found under {SRC}"
    assert not bad, "\n".join(bad)


def test_the_private_name_check_flags_each_rule() -> None:
    source = textwrap.dedent(
        """\
        import sys
        import torch
        import torch.nn.functional as F
        from torch import _C, nn
        from torch.fx import Node
        limit = torch._dynamo.config.cache_size_limit
        torch._C._foo()
        F._canonical_mask(x)
        Node._input_nodes
        getattr(torch.autograd.profiler, "_is_profiler_enabled", False)
        owner = nn.Module()
        owner._modules.get("a")
        torch.ops.aten.mm.default._schema
        getattr(node.target, "_schema", None)
        node.target._schema.is_mutable
        self._parameters
        torch.tensor(1)._version
        """
    )
    assert private_torch_names(source) == [
        (4, "from torch import _C"),
        (6, "torch._dynamo.config.cache_size_limit"),
        (7, "torch._C._foo"),
        (8, "F._canonical_mask"),
        (9, "Node._input_nodes"),
        (10, "getattr(torch.autograd.profiler, '_is_profiler_enabled', False)"),
        (12, "owner._modules.get"),
        (13, "torch.ops.aten.mm.default._schema"),
        (14, "getattr(node.target, '_schema', None)"),
        (15, "node.target._schema.is_mutable"),
        (16, "self._parameters"),
        (17, "torch.tensor(1)._version"),
    ]


def test_the_private_name_check_passes_public_torch_and_op_names() -> None:
    source = textwrap.dedent(
        """\
        import sys
        import torch
        from torch import nn
        from torch.ops import _c10d_functional
        from memfit.plan import Plan
        torch.__version__
        torch.ops.aten._softmax.default(x, 0, False)
        torch.ops._c10d_functional.all_reduce.default
        hasattr(torch.ops.prims, "_low_memory_max_pool_with_offsets")
        aten = torch.ops.aten
        aten._to_copy.default
        sys._getframe(0)
        getattr(Plan, "_cache")
        getattr(self, "_watching", False)
        nn.Module().add_module("a", nn.Linear(1, 1))
        node.target.__name__
        run._steps
        """
    )
    assert private_torch_names(source) == []
