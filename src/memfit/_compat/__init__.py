"""Every private PyTorch API memfit uses, reached through this one package.

memfit works inside ``torch.compile``: it plans on AOTAutograd's joint graph, splits it with
AOTAutograd's own partitioning helper, runs the result with FX's boxed calling convention and
measures CPU memory from the profiler's raw events. None of that has a public API. Private APIs
move between torch releases, so each one is reached here and nowhere else: when torch changes
one, this package is the only place to read, and each entry says what memfit needs it for and the
torch versions it was checked on. A test (``tests/test_compat.py``) calls every entry, so a
release that removes one fails there with the entry's name rather than deep inside a step.

Rule for the rest of the package: no ``import`` from ``torch._*``, ``torch.utils._*``,
``torch._C`` or ``functorch``; use the names below. Public torch APIs (``torch.compile``,
``torch.compiler.reset``, ``torch.profiler.profile``, ``torch.library``, ``torch.fx``) are used
directly.

Private *attributes* count too: outside this package no code reads ``torch._dynamo.config``,
``torch._C._x`` or ``node.target._schema`` (``tests/test_layers.py`` checks, and its NOTE
[Private torch names] says exactly what counts); op names under ``torch.ops``
(``torch.ops.aten._softmax.default``) are public.

One module per torch subsystem, every entry re-exported here: ``names`` (pytrees, AOTAutograd's
backend factory, fake modes, storage identities), ``aot_partitioning`` (AOTAutograd's split and
torch's min-cut), ``autograd`` (tangents, a compiled function's ctx, donation, the engine's
accumulation and a tensor's hooks, boxed code), ``dynamo`` (counters, the recompile limit,
numpy's random functions), ``logging_config`` (logging inside a captured forward),
``symbolic_sizes``, ``profiler`` (raw events), ``inductor`` (what the benchmarks and the Inductor
executor compile with), ``fake`` (fake tensors to plan on), ``measurement``, ``op_schema`` (an
op's schema), ``modules`` (nn.Module's children).
"""

from __future__ import annotations

import warnings

import torch

__all__ = [
    "CHECKED_TORCH_VERSIONS",
    "OpOverload",
    "TorchDispatchMode",
    "StorageWeakRef",
    "aot_autograd",
    "backward_keeps_graph",
    "own_donation",
    "donated_buffers_enabled",
    "boxed_codegen",
    "mark_boxed_call",
    "compiled_backward_ctx",
    "compiled_function_ctx",
    "eager_module_calls",
    "will_engine_accumulate",
    "accumulate_grad_nodes",
    "has_gradient_hooks",
    "op_schema",
    "child_module",
    "own_tensor_tables",
    "detect_fake_mode",
    "FAKE_VALUE_ERRORS",
    "FakeTensorMode",
    "is_fake",
    "disable_current_modes",
    "extract_fwd_bwd_modules",
    "graph_break_reasons",
    "is_tangent",
    "keystr",
    "profiler_enabled",
    "profiler_events",
    "profiler_allocations",
    "profiler_started_anywhere",
    "cpu_memory_device_types",
    "tree_flatten",
    "tree_flatten_with_path",
    "tree_map",
    "tree_map_only",
    "tree_unflatten",
    "frames_converted",
    "unique_graph_count",
    "accumulated_recompile_limit",
    "compile_with_recompile_limit",
    "numpy_random_in_python",
    "logging_functions",
    "traced_logging",
    "is_sym_node",
    "dense_memory_format",
    "size_hint",
    "size_expr",
    "size_symbols",
    # added for benchmarks
    "activation_memory_budget",
    "automatic_dynamic_shapes",
    "default_partition",
    "inductor_post_grad_pass",
    "make_boxed_func",
    # the Inductor executor
    "forward_output_strides",
    "inductor_compile",
    "inductor_schedule",
    "inductor_decompositions",
    "inductor_joint_graph_passes",
    # torch's min-cut partitioner (the Inductor executor's candidates)
    "MIN_CUT_MAX_FLOW",
    "min_cut_node_info",
    "min_cut_saved_values",
    "min_cut_saved_values_at",
]

#: The torch releases every entry below was checked on (the test suite runs on these, and the
#: package requires at least the oldest).
CHECKED_TORCH_VERSIONS = ("2.13.0",)

if torch.__version__.split("+")[0] not in CHECKED_TORCH_VERSIONS:
    warnings.warn(
        f"memfit was checked on torch {', '.join(CHECKED_TORCH_VERSIONS)}, not on torch "
        f"{torch.__version__}: the private torch APIs in memfit._compat may have moved; "
        f"tests/test_compat.py checks each of them",
        stacklevel=2,
    )

from memfit._compat.aot_partitioning import (  # noqa: E402
    MIN_CUT_MAX_FLOW,
    extract_fwd_bwd_modules,
    min_cut_node_info,
    min_cut_saved_values,
    min_cut_saved_values_at,
)
from memfit._compat.aot_partitioning import _partitioners as _partitioners  # noqa: E402
from memfit._compat.autograd import (  # noqa: E402
    accumulate_grad_nodes,
    backward_keeps_graph,
    boxed_codegen,
    compiled_backward_ctx,
    compiled_function_ctx,
    donated_buffers_enabled,
    eager_module_calls,
    has_gradient_hooks,
    is_tangent,
    mark_boxed_call,
    own_donation,
    will_engine_accumulate,
)
from memfit._compat.dynamo import (  # noqa: E402
    accumulated_recompile_limit,
    compile_with_recompile_limit,
    frames_converted,
    graph_break_reasons,
    numpy_random_in_python,
    unique_graph_count,
)
from memfit._compat.fake import (  # noqa: E402
    FAKE_VALUE_ERRORS,
    FakeTensorMode,
    is_fake,
)
from memfit._compat.inductor import (  # noqa: E402
    activation_memory_budget,
    automatic_dynamic_shapes,
    default_partition,
    forward_output_strides,
    inductor_compile,
    inductor_decompositions,
    inductor_joint_graph_passes,
    inductor_post_grad_pass,
    inductor_schedule,
    make_boxed_func,
)
from memfit._compat.logging_config import (  # noqa: E402
    logging_functions,
    traced_logging,
)
from memfit._compat.measurement import (  # noqa: E402
    profiler_started_anywhere,
)
from memfit._compat.modules import (  # noqa: E402
    child_module,
    own_tensor_tables,
)
from memfit._compat.names import (  # noqa: E402
    OpOverload,
    StorageWeakRef,
    TorchDispatchMode,
    aot_autograd,
    detect_fake_mode,
    disable_current_modes,
    keystr,
    tree_flatten,
    tree_flatten_with_path,
    tree_map,
    tree_map_only,
    tree_unflatten,
)
from memfit._compat.op_schema import (  # noqa: E402
    op_schema,
)
from memfit._compat.profiler import (  # noqa: E402
    cpu_memory_device_types,
    profiler_allocations,
    profiler_enabled,
    profiler_events,
)
from memfit._compat.symbolic_sizes import (  # noqa: E402
    dense_memory_format,
    is_sym_node,
    size_expr,
    size_hint,
    size_symbols,
)
