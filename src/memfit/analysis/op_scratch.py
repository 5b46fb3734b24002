"""Scratch memory of each op, measured by running it once on inputs of the right shape.

Why measure: an op may allocate far more than its outputs while it runs. On CPU, oneDNN's
convolution allocates a second output-sized buffer in forward, its backward about twice its
input, a transposed convolution three times its output; on CUDA, cuDNN picks workspaces at run
time. A simulator that counted outputs alone mispredicted a U-Net's peak by 40%, and a planner
that cannot see scratch memory happily recomputes a convolution at the very moment of the peak.
No table of op costs stays true across libraries and devices, so memfit measures. Running the
op also shows the real size of each output's storage, which for a few ops (CPU losses that
reduce in place) is larger than its shape: see NOTE [Outputs larger than their shape].

Each distinct signature (op, shapes, strides, dtypes, constant arguments) runs once (twice on
CUDA, measured on the second: see ``_scratch_on_cuda``), on fresh
tensors filled from a private generator (floats random, integers zero: valid indices for pooling
and embedding backward). Random ops are never run, so the user's RNG stream is untouched. Ops
whose tensors are all small are skipped: their scratch cannot move a peak. One op at a time is
materialised, run and freed, so what the measurement itself holds at its peak is the largest
single op's inputs, outputs and scratch, not the sum over ops.

Where it runs
    This runs inside the user's first call of a ``memfit.checkpoint`` model (AOTAutograd calls the
    partitioner while it traces, under its fake-tensor mode, which is left for real memory), so
    it must not disturb a measurement around that call. On CUDA each op runs inside a
    ``CudaRecording`` (``memfit.measurement``), whose nested frames keep an enclosing
    ``memfit.measure`` intact. On CPU the ops run inside one ``CpuRecording``, a profiler session;
    while another session is active (``memfit.measure`` around the call, a user's
    ``torch.profiler.profile``, either on any thread) a second one would break it and pausing it
    is unsafe (see the NOTE in ``memfit/measurement/cpu.py``), so the ops run in a fresh Python
    process instead (``python -c`` importing this module; about 4 s, mostly importing torch and
    memfit). It receives each op's name, tensor specs and constant arguments, runs the same code
    with the same private generator, and sends back scratch and output storage bytes, so the
    numbers are the same.
    The enclosing session then sees only the step itself, which is the truth of this process.

Symbolic sizes
    A graph captured with dynamic shapes is measured at its hints (the sizes of the captured
    call), read without a guard; ``JointGraph.scale_scratch`` carries the result to other sizes.
"""

from __future__ import annotations

import operator
import os
import pickle
import subprocess
import sys
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from memfit._compat import (
    OpOverload,
    disable_current_modes,
    op_schema,
    size_hint,
    tree_flatten,
    tree_map,
)
from memfit.analysis.graph import allocated_bytes, is_random, is_view_op, node_tensors
from memfit.measurement.cpu import CpuRecording, cpu_recording_blocked
from memfit.measurement.cuda import CudaRecording
from memfit.nn.linear_cross_entropy import working_bytes as lce_working_bytes

__all__ = ["OpMemory", "measure_op_memory", "modelled_op_scratch", "SCRATCH_RULES"]


@dataclass(frozen=True)
class _TensorSpec:
    """What an input tensor looks like; a dataclass, so pytree functions treat it as a leaf."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class _OpCall:
    """One op to run, picklable: its qualified name (``aten.mm.default``) and spec arguments."""

    op: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class OpMemory:
    """What running each op showed about its memory."""

    #: bytes each node allocates while running beyond its outputs (nodes with 0 are left out)
    scratch: dict[fx.Node, int]
    #: the bytes of each output storage the real op returned, per output tensor in the order of
    #: ``node_tensors``, for the nodes where one is larger than its fake tensor says: the storage
    #: stays that large for as long as the output lives (see NOTE [Outputs larger than their
    #: shape]); ``JointGraph.hold_outputs`` counts them
    outputs: dict[fx.Node, tuple[int, ...]]


# NOTE [Outputs larger than their shape]
# Some ATen ops return a tensor whose storage is larger than its shape needs, and fake tensors
# cannot tell. On CPU (torch 2.13) ``mse_loss``, ``smooth_l1_loss``, ``soft_margin_loss`` and
# ``binary_cross_entropy`` compute the unreduced loss into their output and reduce it in place,
# so the 0-dim loss keeps the whole input-sized buffer: a 512x256 MSE's loss holds 524,288 bytes,
# its fake tensor 4. The loss lives until the caller drops it, after the backward, so a step that
# returned it measured one activation above its prediction (+5.9% on an 8-layer MLP) while the
# same loss written as ``(o - y).pow(2).mean()`` was exact. Counting that buffer as the op's
# scratch would free it too early; what is true is the storage's real size, which measuring the
# op already sees.


def measure_op_memory(
    nodes: Iterable[fx.Node], *, min_bytes: int = 0, device: torch.device | None = None
) -> OpMemory:
    """Each node's scratch bytes and, where they are larger than its fake tensors say, the real
    bytes of its output storages, from running one op per signature.

    Args:
        nodes: nodes of a traced graph whose values carry fake tensors (``meta["val"]``).
        min_bytes: skip ops none of whose input or output tensors is at least this large.
        device: where to run the ops; by default the device of the first op's output.
    """
    candidates: dict[Any, list[fx.Node]] = {}
    for n, _ in _considered(nodes, min_bytes):
        candidates.setdefault(_signature(n), []).append(n)
    if not candidates:
        return OpMemory({}, {})
    first = next(iter(candidates.values()))[0]
    dev = device or node_tensors(first)[0].device
    calls = [_op_call(group[0]) for group in candidates.values()]
    if dev.type == "cpu" and cpu_recording_blocked() is not None:
        measured = _scratch_in_subprocess(calls)
    else:
        with disable_current_modes(), torch.no_grad():
            measured = _scratch_of_calls(calls, dev)
    scratch: dict[fx.Node, int] = {}
    outputs: dict[fx.Node, tuple[int, ...]] = {}
    for group, result in zip(candidates.values(), measured):
        if result is None:
            continue
        nbytes, real = result
        fake = tuple(_nbytes_hint_storage(t) for t in node_tensors(group[0]))
        larger = len(real) == len(fake) and any(r > f for r, f in zip(real, fake))
        for n in group:
            if nbytes:
                scratch[n] = nbytes
            if larger:
                outputs[n] = real
    return OpMemory(scratch, outputs)


# NOTE [Op scratch on fake tensors]
# A model planned on fake tensors (``memfit.plan(meta_model, ..., device=...)``) has no real
# tensors to run an op on, and this machine need not be the target, so scratch memory comes from
# a rule per op instead of a measurement: ``SCRATCH_RULES`` by device type, zero for every op
# without one. The CPU rules reproduce what this module measures of torch 2.13's CPU kernels
# (tests/test_op_scratch.py checks each against a measurement):
#  * an op given a Python number wraps it in a 0-dim float64 (int64) tensor, then casts it to
#    the op's dtype: 8 bytes and one element (12 for a float on float32);
#  * native dropout's backward casts its bool mask to the gradient's dtype (one gradient-sized
#    buffer) and wraps its scale; memfit's ``dropout_result`` (``capture.dropout``) casts its
#    mask alike and scales in place;
#  * native BatchNorm's backward allocates one buffer the size of its input;
#  * LayerNorm's backward one float32 row of each of gamma's and beta's gradients per thread;
#  * flash attention's forward (``_scaled_dot_product_flash_attention_for_cpu``) per thread a
#    float32 block of q x kv scores, a row max and a row sum, and a q x head-dim accumulator,
#    with torch's block sizes (q: 256 from L >= 768, 64 from 192, else 32; kv: 512; each at
#    most the sequence length).
# Not modelled (so plans on fake tensors of these differ from measured ones; tests/test_fake_
# target.py states by how much): oneDNN's convolutions, whose workspaces depend on the kernel it
# picks (0.3 to 3 times the output, measured on the zoo), and flash attention's backward on CPU
# (per-thread blocks whose sizes did not follow one formula across shapes: 4 to 8 KiB on the
# zoo's attention). On CUDA every ATen op is zero: cuBLAS's workspace and the CUDA context sit
# outside the caching allocator's per-op blocks (DESIGN.md), and cuDNN chooses convolution
# workspaces at run time from the GPU. On every device, memfit's own chunked loss head
# (``memfit.nn.linear_cross_entropy``) allocates its chunk blocks from its Python, which
# ``working_bytes`` beside the kernel states.


def _first_input_bytes(node: fx.Node) -> int:
    first = node.all_input_nodes[0].meta.get("val") if node.all_input_nodes else None
    return _nbytes_hint(first) if isinstance(first, torch.Tensor) else 0


def _wrapped_numbers(node: fx.Node) -> int:
    """Bytes of the Python numbers among ``node``'s arguments: each wrapped as a 0-dim tensor
    (float64 for a float, int64 for an int) and cast to the dtype of the op's first tensor."""
    first = node.all_input_nodes[0].meta.get("val") if node.all_input_nodes else None
    dtype = first.dtype if isinstance(first, torch.Tensor) else torch.float32
    total = 0
    for a in (*node.args, *node.kwargs.values()):
        if isinstance(a, bool) or not isinstance(a, (int, float, torch.SymInt, torch.SymFloat)):
            continue
        wrapped = torch.int64 if isinstance(a, (int, torch.SymInt)) else torch.float64
        total += 8 + (0 if wrapped == dtype else dtype.itemsize)
    return total


def _dropout_backward(node: fx.Node) -> int:
    """native_dropout_backward on CPU: the mask cast to the gradient's dtype, and the scale."""
    return _first_input_bytes(node) + _wrapped_numbers(node)


def _batch_norm_backward(node: fx.Node) -> int:
    """native_batch_norm_backward on CPU: one buffer the size of its input (``grad_out``)."""
    return _first_input_bytes(node)


def _layer_norm_backward(node: fx.Node) -> int:
    """native_layer_norm_backward on CPU: per thread, a float32 row for each of dgamma and
    dbeta (the normalized shape's elements)."""
    normalized = node.args[2]
    elements = 1
    for size in normalized if isinstance(normalized, (list, tuple)) else ():
        elements *= size_hint(size)
    return 2 * torch.get_num_threads() * elements * 4


def _flash_attention_cpu(node: fx.Node) -> int:
    """_scaled_dot_product_flash_attention_for_cpu: per thread, float32 scores of a q block
    against a kv block, the block's row max and row sum, and its q x head-dim accumulator."""
    q, k = (a.meta.get("val") for a in node.all_input_nodes[:2])
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
        return 0
    q_len, kv_len, head = size_hint(q.shape[-2]), size_hint(k.shape[-2]), size_hint(q.shape[-1])
    q_split = min(256 if q_len >= 768 else 64 if q_len >= 192 else 32, q_len)
    kv_split = min(512, kv_len)
    per_thread = q_split * kv_split + 2 * q_split + q_split * head
    return torch.get_num_threads() * per_thread * 4


def _loss_head(node: fx.Node) -> int:
    """memfit's chunked linear cross-entropy (``memfit.nn.linear_cross_entropy``), forward or
    backward: its chunk blocks (``working_bytes``), on any device: its own Python allocates them
    through the device's allocator."""
    backward = "bwd" in str(node.target)
    args: tuple[Any, ...] = node.args[1:] if backward else node.args
    h, weight, bias = (a.meta.get("val") if isinstance(a, fx.Node) else a for a in args[:3])
    if not isinstance(h, torch.Tensor) or not isinstance(weight, torch.Tensor):
        return 0
    chunk_size = args[7 if backward else 6]
    needs: Any = node.args[9] if backward else (True, True, True)
    return lce_working_bytes(
        size_hint(h.shape[0]),
        size_hint(h.shape[1]),
        size_hint(weight.shape[0]),
        h.dtype,
        int(chunk_size),
        backward=backward,
        need_weight=bool(needs[1]),
        bias=isinstance(bias, torch.Tensor) and bool(needs[2]),
    )


_LOSS_HEAD_RULES = {
    "memfit.linear_cross_entropy_fwd.default": _loss_head,
    "memfit.linear_cross_entropy_bwd.default": _loss_head,
}


_ELEMENTWISE_WITH_NUMBERS = (
    "add",
    "sub",
    "rsub",
    "mul",
    "div",
    "pow",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "remainder",
    "fmod",
    "where",
    "masked_fill",
)


#: Scratch bytes of an op on fake tensors, by device type and op (NOTE [Op scratch on fake
#: tensors]); an op without a rule has none.
SCRATCH_RULES: dict[str, dict[str, Any]] = {
    "cpu": {
        **{
            f"aten.{op}.{overload}": _wrapped_numbers
            for op in _ELEMENTWISE_WITH_NUMBERS
            for overload in ("Tensor", "Scalar")
        },
        "aten.native_dropout_backward.default": _dropout_backward,
        "memfit.dropout_result.default": _first_input_bytes,
        "aten.native_batch_norm_backward.default": _batch_norm_backward,
        "aten.native_layer_norm_backward.default": _layer_norm_backward,
        "aten._scaled_dot_product_flash_attention_for_cpu.default": _flash_attention_cpu,
        **_LOSS_HEAD_RULES,
    },
    "cuda": dict(_LOSS_HEAD_RULES),
}


def modelled_op_scratch(
    nodes: Iterable[fx.Node], *, min_bytes: int = 0, device: torch.device | None = None
) -> dict[fx.Node, int]:
    """``measure_op_memory``'s scratch from ``SCRATCH_RULES`` instead of running the ops: for a
    graph traced on fake tensors of a model that has no real ones (NOTE [Op scratch on fake
    tensors]). The same ops are considered as there (``min_bytes`` included), so an op the
    measurement would skip has no scratch here either."""
    out: dict[fx.Node, int] = {}
    for n, touched in _considered(nodes, min_bytes):
        dev = device or touched[0].device
        rule = SCRATCH_RULES.get(dev.type, {}).get(str(n.target))
        nbytes = rule(n) if rule is not None else 0
        if nbytes:
            out[n] = nbytes
    return out


def _considered(
    nodes: Iterable[fx.Node], min_bytes: int
) -> Iterator[tuple[fx.Node, list[torch.Tensor]]]:
    """The ops ``measure_op_memory`` runs and ``modelled_op_scratch`` models, alike: runnable,
    with an output or input tensor of at least ``min_bytes``; each with those tensors, its
    outputs' first."""
    for n in nodes:
        if not _runnable(n):
            continue
        touched = node_tensors(n) + [t for a in n.all_input_nodes for t in node_tensors(a)]
        if touched and max(_nbytes_hint(t) for t in touched) >= min_bytes:
            yield n, touched


def _nbytes_hint(t: torch.Tensor) -> int:
    return size_hint(t.numel()) * t.element_size()


def _nbytes_hint_storage(t: torch.Tensor) -> int:
    """Bytes of ``t``'s fake storage at the hints (a view's whole base, as a real one)."""
    try:
        return size_hint(t.untyped_storage().nbytes())
    except (NotImplementedError, RuntimeError):
        return _nbytes_hint(t)


def _hints(values: Any) -> tuple[int, ...]:
    return tuple(size_hint(v) for v in values)


def _runnable(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target is operator.getitem or is_random(node):
        return False
    if not isinstance(node.target, OpOverload):
        return False
    if op_schema(node.target).is_mutable or is_view_op(node):
        return False  # in-place ops and views allocate nothing of their own
    return all(isinstance(a.meta.get("val"), torch.Tensor) for a in node.all_input_nodes)


def _signature(node: fx.Node) -> Any:
    def key(a: Any) -> Any:
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):
                return ("T", _hints(v.shape), _hints(v.stride()), v.dtype, v.device.type)
            return ("N", repr(v))
        return repr(size_hint(a)) if isinstance(a, torch.SymInt) else repr(a)

    flat, _ = tree_flatten((node.args, node.kwargs))
    return (str(node.target), tuple(key(a) for a in flat))


def _op_call(node: fx.Node) -> _OpCall:
    def spec(a: Any) -> Any:
        if isinstance(a, fx.Node):
            v = a.meta["val"]
            return _TensorSpec(_hints(v.shape), _hints(v.stride()), v.dtype)
        return size_hint(a) if isinstance(a, torch.SymInt) else a

    return _OpCall(str(node.target), tree_map(spec, node.args), tree_map(spec, dict(node.kwargs)))


def _resolve(name: str) -> Any:
    namespace, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


def _materialize(spec: _TensorSpec, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """A real tensor with ``spec``'s shape, strides (overlapping ones too) and dtype."""
    span = 1 + sum((size - 1) * stride for size, stride in zip(spec.shape, spec.stride))
    span = max(span, 0) if all(spec.shape) else 0
    if spec.dtype.is_floating_point or spec.dtype.is_complex:
        base = torch.randn(span, generator=gen, dtype=spec.dtype).to(device)
    else:
        base = torch.zeros(span, dtype=spec.dtype, device=device)
    return base.as_strided(spec.shape, spec.stride)


#: what running one op measured: its scratch bytes, and the bytes of each output tensor's storage
Measured = tuple[int, tuple[int, ...]]


def _scratch_of_calls(calls: list[_OpCall], dev: torch.device) -> list[Measured | None]:
    """Scratch bytes and output storage bytes of each call, run one at a time; None where it
    could not run.

    On CPU all calls share one recording, each op's scratch read from its own time window:
    a profiler session per op would cost a session start each (and kineto logs every one).
    """
    gen = torch.Generator().manual_seed(0)
    if dev.type == "cuda":
        return [_scratch_on_cuda(call, dev, gen) for call in calls]
    windows: list[tuple[int, int] | None] = []
    outputs: list[tuple[int, ...]] = []
    with CpuRecording() as recording:
        for call in calls:
            prepared = _prepare(call, dev, gen)
            if prepared is None:
                windows.append(None)
                continue
            start = time.time_ns()
            result = _run(*prepared)
            end = time.time_ns()
            if result is _FAILED:
                windows.append(None)
                continue
            windows.append((start, end))
            outputs.append(_output_storages(result))
            del prepared, result
    peaks = iter(recording.window_peaks([w for w in windows if w is not None]))
    out_sizes = iter(outputs)
    measured: list[Measured | None] = []
    for w in windows:
        if w is None:
            measured.append(None)
            continue
        sizes = next(out_sizes)
        measured.append((max(0, next(peaks) - _held(sizes, dev)), sizes))
    return measured


_FAILED = object()


def _prepare(call: _OpCall, dev: torch.device, gen: torch.Generator) -> tuple[Any, ...] | None:
    """The op and real arguments of ``call``; None if they cannot be made."""

    def real(a: Any) -> Any:
        return _materialize(a, dev, gen) if isinstance(a, _TensorSpec) else a

    try:
        return _resolve(call.op), tree_map(real, call.args), tree_map(real, call.kwargs)
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None  # not materializable (exotic dtype or layout): counted as no scratch


def _scratch_on_cuda(call: _OpCall, dev: torch.device, gen: torch.Generator) -> Measured | None:
    """The op's scratch on its second call: a first call may allocate what the process then keeps
    for good (the first matmul, cuBLAS's workspace: 32 MiB on an H200), which the step pays once,
    not on every call; counted as scratch it put 32 MiB in a 4 KiB MLP's first plan and none in
    the second, so the plan depended on what the process had run before."""
    prepared = _prepare(call, dev, gen)
    if prepared is None:
        return None
    with CudaRecording(dev):  # nested, so an enclosing memfit.measure keeps its peak
        first = _run(*prepared)
    if first is _FAILED:
        return None
    del first
    with CudaRecording(dev) as cuda:
        result = _run(*prepared)
    if result is _FAILED:
        return None
    sizes = _output_storages(result)
    return max(0, cuda.peak_bytes - _held(sizes, dev)), sizes


def _output_storages(result: Any) -> tuple[int, ...]:
    """The bytes of each output tensor's storage (its whole storage: see NOTE [Outputs larger
    than their shape])."""
    outputs = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
    return tuple(t.untyped_storage().nbytes() for t in outputs)


def _held(sizes: tuple[int, ...], dev: torch.device) -> int:
    """What the allocator holds for an op's outputs: on CUDA whole 512-byte blocks, as the
    simulator counts them (``allocated_bytes``), so the rounding is not counted as scratch too."""
    return sum(allocated_bytes(n, dev) for n in sizes)


def _run(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    try:
        return op(*args, **kwargs)
    except Exception:  # an op that cannot run on made-up values: counted as no scratch
        return _FAILED


# ----------------------------------------------------------------------------- subprocess

_WORKER = "from memfit.analysis.op_scratch import _serve; _serve()"


def _scratch_in_subprocess(calls: list[_OpCall]) -> list[Measured | None]:
    """:func:`_scratch_of_calls` on CPU in a fresh process (see "Where it runs" above)."""
    sendable: list[int] = []
    payload = []
    for i, call in enumerate(calls):
        try:
            payload.append(pickle.dumps(call))
        except Exception:  # a constant argument that does not pickle: counted as no scratch
            continue
        sendable.append(i)
    out: list[Measured | None] = [None] * len(calls)
    if not payload:
        return out
    src = str(Path(__file__).resolve().parents[2])  # the directory holding the memfit package
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    # Settings that change which kernel runs, and so its scratch (oneDNN's depends on threads).
    settings = (
        torch.get_num_threads(),
        torch.backends.mkldnn.enabled,
        torch.are_deterministic_algorithms_enabled(),
    )
    proc = subprocess.run(
        [sys.executable, "-c", _WORKER],
        input=pickle.dumps((settings, payload)),
        capture_output=True,
        env=env,
        check=False,
    )
    try:
        results = pickle.loads(proc.stdout) if proc.returncode == 0 else None
    except Exception:
        results = None
    if not isinstance(results, list) or len(results) != len(sendable):
        tail = proc.stderr.decode(errors="replace").strip().splitlines()[-5:]
        warnings.warn(
            f"memfit: measuring op scratch memory outside the active profiler session failed "
            f"(worker exit status {proc.returncode}: {' | '.join(tail) or 'no output'}); "
            f"planning without scratch memory for {len(calls)} ops.",
            RuntimeWarning,
            stacklevel=2,
        )
        return out
    for i, measured in zip(sendable, results):
        out[i] = measured
    return out


def _serve() -> None:
    """The worker: read settings and pickled calls on stdin, write what each measured (scratch
    and output storage bytes) to stdout."""
    result_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything else printed to stdout (by torch, by C code) goes to stderr
    (threads, mkldnn, deterministic), blobs = pickle.load(sys.stdin.buffer)
    torch.set_num_threads(threads)
    torch.backends.mkldnn.enabled = mkldnn
    torch.use_deterministic_algorithms(deterministic)
    calls = [pickle.loads(blob) for blob in blobs]
    with torch.no_grad():
        scratch = _scratch_of_calls(calls, torch.device("cpu"))
    pickle.dump(scratch, result_out)
    result_out.close()
