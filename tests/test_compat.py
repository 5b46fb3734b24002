"""Every private torch API memfit reaches through ``memfit._compat`` still does what memfit needs.

When a torch release moves one of them, this file fails with the entry's name, rather than a
training step failing somewhere deep inside capture or measurement.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import pytest
import torch
import torch.fx as fx
from torch.profiler import ProfilerActivity, profile

from conftest import CUDA
from memfit import _compat


def test_checked_versions_name_this_torch() -> None:
    assert torch.__version__.split("+")[0] in _compat.CHECKED_TORCH_VERSIONS


def test_pytrees() -> None:
    tree = {"a": (torch.ones(1), 2), "b": [3]}
    leaves, spec = _compat.tree_flatten(tree)
    assert len(leaves) == 3
    assert _compat.tree_unflatten(leaves, spec)["b"] == [3]
    assert _compat.tree_map(lambda x: x, tree)["b"] == [3]
    doubled = _compat.tree_map_only(int, lambda x: 2 * x, tree)
    assert doubled["a"][1] == 4 and doubled["b"] == [6]
    paths = [_compat.keystr(p) for p, _ in _compat.tree_flatten_with_path(tree)[0]]
    assert paths == ["['a'][0]", "['a'][1]", "['b'][0]"]


def test_dispatch_modes_and_fake_tensors() -> None:
    seen: list[Any] = []

    class Spy(_compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Spy():
        torch.ones(2) + 1
        with _compat.disable_current_modes():
            torch.ones(2) * 2
    assert torch.ops.aten.add.Tensor in seen and torch.ops.aten.mul.Tensor not in seen
    assert isinstance(torch.ops.aten.mm.default, _compat.OpOverload)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = torch.empty(3)
    assert _compat.detect_fake_mode([fake]) is mode
    t = torch.ones(4)
    assert _compat.StorageWeakRef(t.untyped_storage()) == _compat.StorageWeakRef(
        t[1:].untyped_storage()
    )


def test_aot_autograd_split_and_boxed_code() -> None:
    """A joint graph split by hand with the calling convention AOTAutograd expects, run boxed."""
    tangents: list[bool] = []

    def partition(joint: fx.GraphModule, inputs: Any, **kwargs: Any) -> Any:
        tangents.extend(_compat.is_tangent(n) for n in joint.graph.nodes if n.op == "placeholder")
        saved = [
            n for n in joint.graph.nodes if n.op == "placeholder" and not _compat.is_tangent(n)
        ]
        return _compat.extract_fwd_bwd_modules(
            joint,
            saved,
            num_fwd_outputs=kwargs["num_fwd_outputs"],
            static_lifetime_input_indices=kwargs.get("static_lifetime_input_indices"),
        )

    def boxed(gm: fx.GraphModule, _: Any) -> Any:
        gm.graph.set_codegen(_compat.boxed_codegen())
        gm.recompile()

        def run(args: list[Any]) -> Any:
            out = gm(args)
            assert not args, "the boxed code clears its argument list"
            return out

        return _compat.mark_boxed_call(run)  # called with one list, which it may clear

    torch.compiler.reset()
    before = _compat.unique_graph_count()
    f = torch.compile(
        lambda x: torch.tanh(x).sum(),
        dynamic=False,
        backend=_compat.aot_autograd(fw_compiler=boxed, bw_compiler=boxed, partition_fn=partition),
    )
    x = torch.randn(5, requires_grad=True)
    f(x).backward()
    torch.testing.assert_close(x.grad, 1 - torch.tanh(x.detach()) ** 2)
    assert tangents.count(True) == 1 and tangents.count(False) == 1
    assert _compat.unique_graph_count() == before + 1


def test_graph_break_reasons_count_new_breaks() -> None:
    def untraceable_call(x: torch.Tensor) -> torch.Tensor:
        y = x + 1
        print("a side effect Dynamo cannot trace")  # the graph break under test
        return y * 2

    def data_dependent(x: torch.Tensor) -> torch.Tensor:
        y = x + 1
        if y.sum() > 0:  # the graph break under test
            y = y * 2
        return y

    for fn in (untraceable_call, data_dependent):
        torch.compiler.reset()
        before = sum(_compat.graph_break_reasons().values())
        torch.compile(fn, backend="eager")(torch.ones(2))
        assert sum(_compat.graph_break_reasons().values()) > before, fn.__name__


def test_frames_converted_changes_with_each_conversion_and_each_reset() -> None:
    """The token stands while Dynamo serves calls from its cache and changes when it converts a
    frame; after Dynamo's counters are cleared (as its own test cases clear them) it differs even
    where the count comes back to the same value."""
    f = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    torch.compiler.reset()
    frames, total = _compat.frames_converted()
    f(torch.ones(2))
    after_first = _compat.frames_converted()
    assert after_first[0] is frames and after_first[1] > total
    f(torch.ones(2))  # a cache hit
    assert _compat.frames_converted()[1] == after_first[1]
    torch.compiler.reset()
    torch._dynamo.utils.counters.clear()
    f(torch.ones(2))
    assert _compat.frames_converted()[0] is not frames


def test_profiler_events_and_allocations() -> None:
    assert not _compat.profiler_enabled()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        assert _compat.profiler_enabled()
        block = torch.empty(1000, dtype=torch.uint8)
        del block
    cpu = _compat.cpu_memory_device_types()
    sizes = [
        e.nbytes()
        for e in _compat.profiler_events(prof)
        if e.name() == "[memory]" and e.device_type() in cpu
    ]
    assert 1000 in sizes and -1000 in sizes
    allocations = _compat.profiler_allocations(prof)
    assert allocations is not None
    assert {n for _, n, _ in allocations} >= {1000, -1000}
    assert len({ptr for _, n, ptr in allocations if abs(n) == 1000}) == 1


def test_accumulated_recompile_limit_is_raised_only_inside_the_context() -> None:
    import torch._dynamo.config as dynamo_config

    before = dynamo_config.accumulated_recompile_limit
    per_code = dynamo_config.recompile_limit
    with _compat.accumulated_recompile_limit(1000):
        assert dynamo_config.accumulated_recompile_limit == 1000
        assert dynamo_config.recompile_limit == per_code  # torch.compile's parameter lifts it
    assert dynamo_config.accumulated_recompile_limit == before


@pytest.mark.parametrize("entry", ["context variable", "attributes"])
def test_accumulated_limit_restores_the_config_exactly(
    entry: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Set through the config entry's context variable (checked 2.13.0), the limit is reset, not
    written back: a config the user never set reads as unset afterwards, as a default. Where the
    entry is laid out otherwise, attributes are read and written."""
    import torch._dynamo.config as dynamo_config

    if entry == "attributes":
        monkeypatch.setattr(_compat.dynamo, "_LIMIT_ENTRY", None)
    name = "accumulated_recompile_limit"
    before = dynamo_config.accumulated_recompile_limit
    was_default = dynamo_config._is_default(name)
    with _compat.accumulated_recompile_limit(before + 1000):
        assert dynamo_config.accumulated_recompile_limit == before + 1000
        assert not dynamo_config._is_default(name)
    assert dynamo_config.accumulated_recompile_limit == before
    if entry == "context variable":
        assert dynamo_config._is_default(name) == was_default


def test_accumulated_limit_never_lowers_a_users_limit_and_restores_after_an_error() -> None:
    import torch._dynamo.config as dynamo_config

    with dynamo_config.patch(accumulated_recompile_limit=6000):
        with _compat.accumulated_recompile_limit(1000):
            assert dynamo_config.accumulated_recompile_limit == 6000
        try:
            with _compat.accumulated_recompile_limit(9000):
                assert dynamo_config.accumulated_recompile_limit == 9000
                raise KeyError("inside")
        except KeyError:
            pass
        assert dynamo_config.accumulated_recompile_limit == 6000


def test_compiled_function_ctx_and_will_engine_accumulate() -> None:
    """The forward and the backward of an AOTAutograd graph find the same ctx, and inside a
    backward the engine says which leaves it accumulates into, asked with the leaf or with its
    AccumulateGrad node as the ctx's edges give it."""
    found: dict[str, object] = {}
    asked: list[bool] = []
    w = torch.ones(3, requires_grad=True)
    v = torch.ones(3, requires_grad=True)

    def compiler(kind: str) -> Any:
        def compile_graph(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            def run(args: list[Any]) -> Any:
                found[kind] = _compat.compiled_function_ctx(frames=5)
                running = _compat.compiled_backward_ctx()
                assert running is (found[kind] if kind == "backward" else None)
                if kind == "backward":
                    asked.append(_compat.will_engine_accumulate(w))
                    # The same answer from the leaf's node read off the running backward's node.
                    node = _compat.accumulate_grad_nodes(found[kind])[id(w)]
                    assert node.variable is w
                    asked.append(_compat.will_engine_accumulate(w, node))
                return _compat.make_boxed_func(gm)(args)

            run._boxed_call = True  # type: ignore[attr-defined]
            return run

        return compile_graph

    backend = _compat.aot_autograd(
        fw_compiler=compiler("forward"), bw_compiler=compiler("backward")
    )
    f = torch.compile(lambda a, b: (a * b).sin().sum(), backend=backend)
    f(w, v).backward()
    assert found["forward"] is not None and found["forward"] is found["backward"]
    f(w, v).backward(inputs=[v])
    torch.autograd.grad(f(w, v), [w])
    assert asked == [True, True, False, False, False, False]


def test_donated_buffers_enabled_reads_aotautograds_config_on_each_call() -> None:
    import torch._functorch.config as functorch_config

    assert _compat.donated_buffers_enabled() is bool(functorch_config.donated_buffer)
    for donated in (False, True):
        with functorch_config.patch(donated_buffer=donated):
            assert _compat.donated_buffers_enabled() is donated


def test_has_gradient_hooks_sees_a_tensor_hook_and_a_post_accumulate_hook() -> None:
    for register in ("register_hook", "register_post_accumulate_grad_hook"):
        leaf = torch.zeros(2, requires_grad=True)
        assert not _compat.has_gradient_hooks(leaf)
        handle = getattr(leaf, register)(lambda value: None)
        assert _compat.has_gradient_hooks(leaf), register
        handle.remove()
        assert not _compat.has_gradient_hooks(leaf), register


def test_op_schema_says_which_ops_write_and_which_return_views() -> None:
    aten = torch.ops.aten
    assert _compat.op_schema(aten.add_.Tensor).is_mutable
    assert not _compat.op_schema(aten.mm.default).is_mutable
    assert _compat.op_schema(aten.t.default).returns[0].alias_info is not None
    assert _compat.op_schema(aten.mm.default).returns[0].alias_info is None
    assert _compat.op_schema(aten.mm.default).name == "aten::mm"
    assert _compat.op_schema(operator.getitem) is None


def test_child_module_finds_children_only_under_each_of_their_names() -> None:
    parent = torch.nn.Module()
    child = torch.nn.Linear(1, 1)
    parent.add_module("a", child)
    parent.add_module("b", child)
    parent.register_module("empty", None)
    parent.register_buffer("buffer", torch.zeros(1))
    assert _compat.child_module(parent, "a") is child
    assert _compat.child_module(parent, "b") is child
    for name in ("empty", "buffer", "missing"):
        assert _compat.child_module(parent, name) is None, name


def test_own_tensor_tables_are_the_modules_own_parameters_and_buffers() -> None:
    bn = torch.nn.BatchNorm1d(3)
    params, buffers = _compat.own_tensor_tables(bn)
    assert params["weight"] is bn.weight and buffers["running_mean"] is bn.running_mean
    saved = params["weight"]
    params["weight"] = torch.nn.Parameter(torch.ones(3))
    assert torch.equal(bn.weight, torch.ones(3))
    params["weight"] = saved
    assert bn.weight is saved and list(bn.state_dict()) == list(
        torch.nn.BatchNorm1d(3).state_dict()
    )


def test_fake_tensor_mode_makes_fake_tensors_and_parameters() -> None:
    with _compat.FakeTensorMode():
        fake = torch.empty(1024, 1024)
    assert _compat.is_fake(fake) and _compat.is_fake(torch.nn.Parameter(fake))
    assert not _compat.is_fake(torch.empty(1)) and not _compat.is_fake(None)


def test_eager_module_calls_name_the_modules_whose_call_broke_the_graph() -> None:
    """Asked from a backend, the modules running eagerly are those whose call Dynamo could not
    trace into its caller's graph: the root and the layer with the break, not its Linear."""

    class Breaks(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.fc(x)
            if x.sum() > 0:  # a graph break inside this module's call
                x = x * 2
            return x

    class Root(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Breaks()
            self.head = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.inner(x))

    root = Root()
    seen: set[int] = set()

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        seen.update(id(m) for m in _compat.eager_module_calls())
        return gm.forward

    torch.compile(root, backend=backend)(torch.ones(2, 4))
    assert id(root.inner) in seen and id(root) in seen
    assert id(root.inner.fc) not in seen and id(root.head) not in seen
    assert _compat.eager_module_calls() == []


def test_symbolic_sizes_read_without_guards_and_split_with_the_sizes_saved() -> None:
    """A graph captured with a symbolic size: its SymInts read at their hint without adding a
    guard, their expression and symbols, the size nodes told apart, and a split that hands the
    backward the sizes it reads (saved apart from tensors)."""
    seen: dict[str, Any] = {}

    def partition(joint: fx.GraphModule, inputs: Any, **kwargs: Any) -> Any:
        nodes = list(joint.graph.nodes)
        sizes = [n for n in nodes if _compat.is_sym_node(n)]
        x = next(n for n in nodes if isinstance(n.meta.get("val"), torch.Tensor))
        numel = x.meta["val"].numel()
        env = numel.node.shape_env
        guards = len(env.guards)
        seen["hint"] = _compat.size_hint(numel)
        seen["unguarded"] = len(env.guards) == guards
        seen["expr"] = str(_compat.size_expr(numel))
        seen["symbols"] = {str(s) for s in _compat.size_symbols(x.meta["val"])}
        seen["sizes"] = bool(sizes)
        tensors = [n for n in nodes if isinstance(n.meta.get("val"), torch.Tensor)]
        saved = [n for n in tensors if n.op == "placeholder" and not _compat.is_tangent(n)]
        return _compat.extract_fwd_bwd_modules(
            joint, saved + sizes, num_fwd_outputs=kwargs["num_fwd_outputs"]
        )

    torch.compiler.reset()
    backend = _compat.aot_autograd(
        fw_compiler=lambda g, _: _compat.make_boxed_func(g.forward), partition_fn=partition
    )
    f = torch.compile(lambda x: torch.tanh(x).sum(), dynamic=True, backend=backend)
    x = torch.randn(6, 4, requires_grad=True)
    f(x).backward()
    torch.testing.assert_close(x.grad, 1 - torch.tanh(x.detach()) ** 2)
    assert seen["hint"] == 24 and seen["unguarded"] and seen["sizes"]
    assert len(seen["symbols"]) == 2 and all(s in seen["expr"] for s in seen["symbols"])
    assert _compat.size_hint(7) == 7 and _compat.size_expr(7) == 7


def test_dense_memory_format_names_the_layout_of_dense_strides_only() -> None:
    x = torch.empty(2, 3, 4, 5)
    assert _compat.dense_memory_format(x) == torch.contiguous_format
    assert _compat.dense_memory_format(x.to(memory_format=torch.channels_last)) == (
        torch.channels_last
    )
    volume = torch.empty(2, 3, 4, 5, 6).to(memory_format=torch.channels_last_3d)
    assert _compat.dense_memory_format(volume) == torch.channels_last_3d
    # both layouts at once (one channel): eager's default is the one named
    assert _compat.dense_memory_format(torch.empty(2, 1, 4, 5)) == torch.contiguous_format
    assert _compat.dense_memory_format(x.transpose(0, 1)) is None
    assert _compat.dense_memory_format(torch.empty(3, 1).expand(3, 4)) is None


def test_automatic_dynamic_shapes_off_captures_every_size_again() -> None:
    torch.compiler.reset()
    f = torch.compile(lambda x: x * 2, backend="eager")
    before = _compat.unique_graph_count()
    with _compat.automatic_dynamic_shapes(False):
        for n in (3, 4, 5):
            f(torch.randn(n))
    assert _compat.unique_graph_count() == before + 3
    torch.compiler.reset()
    before = _compat.unique_graph_count()
    with _compat.automatic_dynamic_shapes(True):
        for n in (3, 4, 5):
            f(torch.randn(n))
    assert _compat.unique_graph_count() == before + 2  # the second size as a symbol serves 5


def test_inductor_compile_reports_its_schedule() -> None:
    """Inductor's scheduler still picks its order in ``memory.reorder_for_peak_memory``, whose
    timeline names every buffer, and the lowering names the buffer of each output."""

    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.mm(x, x)
        return (y.relu() + 1, y)

    from torch.fx.experimental.proxy_tensor import make_fx

    x = torch.randn(16, 16)
    gm = make_fx(f)(x)
    schedules: list[Any] = []
    compiled = _compat.inductor_compile(
        gm, [x], is_backward=False, is_inference=True, schedules=schedules
    )
    out = compiled([x])
    assert torch.allclose(out[0], torch.mm(x, x).relu() + 1)
    (timeline, outputs) = schedules[-1]
    assert len(outputs) == 2
    buffers = {name: alloc for name, is_input, alloc, _, _, _ in timeline if not is_input}
    assert outputs[1] in buffers and buffers[outputs[1]] == 16 * 16 * 4
    with _compat.forward_output_strides() as strides:  # no tracing context here
        assert strides is None


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=CUDA,
        ),
    ],
)
def test_inductor_compile_writes_into_donated_inputs_only(device: str) -> None:
    """A backward input given as donated is storage Inductor may reuse: the result of an
    elementwise op of its size is written into it (Inductor still reads its donated inputs from
    ``torch._inductor.graph.get_donated_idxs``). Not given, a new buffer is allocated."""

    def f(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.sigmoid(a) * b,)

    from torch.fx.experimental.proxy_tensor import make_fx

    examples = [torch.randn(64, device=device), torch.randn(64, device=device)]
    for donated in ([0], []):
        gm = make_fx(f)(*examples)
        compiled = _compat.inductor_compile(
            gm, examples, is_backward=True, is_inference=False, donated_inputs=donated
        )
        a, b = torch.randn(64, device=device), torch.randn(64, device=device)
        expected = torch.sigmoid(a) * b
        where = a.data_ptr()
        args = [a, b]
        del a  # the argument list is its only reference, as in memfit's backward
        (out,) = compiled(args)
        torch.testing.assert_close(out, expected)
        assert (out.data_ptr() == where) == bool(donated), donated


def test_min_cut_budgets_solved_together_put_torchs_solver_back_even_on_error() -> None:
    """While budgets are solved together torch's solver and runtime estimate are memoised in
    place and networkx's min-cut uses another max-flow; afterwards (also after an error) they
    are torch's and networkx's own again."""
    import networkx
    import pytest

    from memfit.bench.graphs import joint_graphs

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    (jg,) = joint_graphs(net, torch.randn(4, 8), executor="inductor")
    solve, estimate = _compat._partitioners.solve_min_cut, _compat._partitioners.estimate_runtime
    minimum_cut = networkx.minimum_cut
    kwargs = dict(num_fwd_outputs=jg.num_fwd_outputs, static_lifetime_input_indices=())
    answers = _compat.min_cut_saved_values_at(jg.module, memory_budgets=[None, 0.5], **kwargs)
    assert answers[0] == _compat.min_cut_saved_values(jg.module, **kwargs)
    assert answers[1] == _compat.min_cut_saved_values(jg.module, memory_budget=0.5, **kwargs)
    info = _compat.min_cut_node_info(jg.module, **kwargs)  # classified once, for both budgets
    assert info.required_fw_nodes and info.required_bw_nodes
    assert (
        _compat.min_cut_saved_values_at(
            jg.module, memory_budgets=[None, 0.5], node_info=info, **kwargs
        )
        == answers
    )
    with pytest.raises(RuntimeError, match="memory budget"):
        _compat.min_cut_saved_values_at(jg.module, memory_budgets=[2.0], **kwargs)
    assert _compat._partitioners.solve_min_cut is solve
    assert _compat._partitioners.estimate_runtime is estimate
    assert networkx.minimum_cut is minimum_cut  # its max-flow is networkx's default again


@pytest.mark.parametrize("entry", ["context variable", "attributes"])
def test_traced_logging_extends_dynamos_logging_sets_only_inside_the_context(
    entry: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inside, Dynamo replays ``warnings.warn`` and ``logging.warning`` and ignores
    ``logging.Logger`` methods, the ones ``transformers`` adds when imported too; the user's own
    entries stay (one they ignore is not replayed); after, the config is as before."""
    import logging
    import warnings

    import torch._dynamo.config

    dynamo_config: Any = torch._dynamo.config
    if entry == "attributes":
        monkeypatch.setattr(_compat.logging_config, "_LOGGING_ENTRIES", None)

    def warning_once(self: logging.Logger, *args: Any) -> None:
        self.warning(*args)

    monkeypatch.setattr(logging.Logger, "warning_once", warning_once, raising=False)
    names = ("reorderable_logging_functions", "ignore_logging_functions")
    was_default = [dynamo_config._is_default(name) for name in names]
    with dynamo_config.patch(ignore_logging_functions={logging.error}):
        with _compat.traced_logging():
            reordered = dynamo_config.reorderable_logging_functions
            ignored = dynamo_config.ignore_logging_functions
            assert {warnings.warn, logging.warning} <= reordered
            assert logging.error in ignored and logging.error not in reordered
            assert {logging.Logger.warning, logging.Logger.info, warning_once} <= ignored
            assert dynamo_config.ignore_logger_methods == ignored  # the old name, an alias
        assert dynamo_config.ignore_logging_functions == {logging.error}
        assert warnings.warn not in dynamo_config.reorderable_logging_functions
    if entry == "context variable":
        assert [dynamo_config._is_default(name) for name in names] == was_default


_LOGGER = __import__("logging").getLogger(__name__)


def _inlined_helper(x: torch.Tensor) -> torch.Tensor:
    import warnings

    warnings.warn("memfit test: from an inlined function", stacklevel=2)
    return x * 2


def test_traced_logging_lets_dynamo_capture_logging_calls_in_one_graph() -> None:
    """A logger call, ``logging.warning`` and ``warnings.warn`` compile into one graph. Dynamo
    (checked 2.13.0) replays the compiled frame's ``warnings.warn`` after the graph, drops the
    inlined function's, and drops the logger's (NOTE [logging without graph breaks]): should
    this start to fail because the inlined warning appears, torch replays it now; say so there."""
    import warnings

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x + 1
        _LOGGER.warning("memfit test: a logger call %d", 3)
        warnings.warn("memfit test: from the compiled frame", stacklevel=2)
        return _inlined_helper(y)

    torch.compiler.reset()
    before = sum(_compat.graph_break_reasons().values())
    graphs = _compat.unique_graph_count()
    with _compat.traced_logging(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(fn, backend="eager")(torch.ones(2))
    assert torch.equal(out, torch.full((2,), 4.0))
    assert sum(_compat.graph_break_reasons().values()) == before
    assert _compat.unique_graph_count() == graphs + 1
    assert [str(w.message) for w in caught] == ["memfit test: from the compiled frame"]


def test_errors_are_never_silenced_in_a_compiled_forward() -> None:
    """Only messages up to warnings are skipped; an error breaks the graph and is emitted."""
    _, ignored = _compat.logging_functions()
    assert logging.Logger.warning in ignored and logging.Logger.info in ignored
    for method in (logging.Logger.error, logging.Logger.exception, logging.Logger.critical):
        assert method not in ignored


def test_numpy_random_in_python_leaves_numpys_draws_to_numpy() -> None:
    """Inside the context a compiled function's ``np.random`` calls draw from numpy's own
    stream, as the function run eagerly does (by default Dynamo traces them as draws from
    torch's generator); the config is as it was afterwards."""
    import numpy as np
    import torch._dynamo.config as dynamo_config

    def draw(x: torch.Tensor) -> torch.Tensor:
        return x + torch.as_tensor(np.random.rand(3))

    x = torch.zeros(3, dtype=torch.float64)
    np.random.seed(0)
    expected = draw(x)
    after = np.random.get_state()[2]
    torch.compiler.reset()
    compiled = torch.compile(draw, backend="eager")
    np.random.seed(0)
    with _compat.numpy_random_in_python():
        assert dynamo_config.use_numpy_random_stream
        got = compiled(x)
    assert torch.equal(got, expected)
    assert np.random.get_state()[2] == after
    assert not dynamo_config.use_numpy_random_stream
    assert dynamo_config._is_default("use_numpy_random_stream")
    torch.compiler.reset()
