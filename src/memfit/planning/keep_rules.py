"""Keep-set rules: which forward values to keep for backward. Everything not kept is recomputed.

Each rule answers the same question over one ``JointGraph`` with a different objective:

* ``keep_all``      — ``"none"``: keep whatever backward reads (plain autograd).
* ``keep_heavy``    — ``"speed"``: keep outputs of matmul/conv/attention; recompute cheap ops.
* ``keep_marked``   — ``"collection"`` and module names: keep exactly what the user marked.
* ``keep_min_peak`` — the cut heuristic below: the smallest simulated peak over cut plans. It is
  one candidate of the frontier whose lowest point ``"memory"`` returns (``planning.frontier``).
* ``keep_blocks``   — per-block checkpointing as users write it by hand, from the module
  structure: another candidate of that frontier, so ``"memory"`` never peaks above it.

Every policy also keeps random ops' outputs (a second draw would differ) and the forward outputs
(alive anyway). In this design each forward op appears at most once in the backward graph, so any
kept set recomputes each op at most once: at most one extra forward pass, by construction.

How the cut heuristic works on any graph. OpenAI's tool looked for single-node separators and failed
on U-Nets, RNNs and DenseNets, which have none. Here a *cut* is a position in the topological
order of the forward graph, and what must be kept at a cut is its whole frontier: every value
produced before it and read after it (a long skip crosses many cuts and is one of many frontier
values; nothing requires a single node). For a target segment size L, cuts are placed greedily
where the frontier is smallest among the last ~L/2 bytes of forward; each L gives one candidate,
the memory simulator scores it, and the best wins. The plain plan is always a candidate, so the
result never keeps more than no checkpointing. On a chain of n equal layers the best L is about
√n layers, which gives the O(√n) of Chen et al.
"""

from __future__ import annotations

import bisect
import re

import torch.fx as fx

from memfit._compat import is_sym_node
from memfit.analysis.cost import is_compute_heavy
from memfit.analysis.graph import JointGraph
from memfit.analysis.simulate import simulate_step
from memfit.capture.mark import MARK_META

__all__ = [
    "always_kept",
    "keep_all",
    "keep_blocks",
    "keep_heavy",
    "keep_marked",
    "keep_min_peak",
    "input_derived",
]


def always_kept(jg: JointGraph) -> set[fx.Node]:
    """Values every plan keeps: random and impure ops' outputs, and the forward outputs."""
    kept = {n for n in jg.forward if jg.must_save(n)}
    kept |= set(jg.fwd_outputs)
    # multi-output random ops (native_dropout) are kept through their getitems
    for n in list(kept):
        if not jg.is_tensor_value(n):
            kept |= {u for u in n.users if jg.is_getitem(u)}
    return {n for n in kept if jg.is_tensor_value(n)}


def _candidates(jg: JointGraph) -> list[fx.Node]:
    return [n for n in jg.forward if jg.is_tensor_value(n)]


def keep_all(jg: JointGraph) -> set[fx.Node]:
    """Keep every forward value backward reads: the baseline without checkpointing, less the
    values made from the step's inputs alone (:func:`input_derived`), which the backward makes
    again from those inputs."""
    derived = input_derived(jg)
    return jg.saved_needed([n for n in _candidates(jg) if n not in derived])


def input_derived(jg: JointGraph) -> set[fx.Node]:
    """Forward values computed by cheap ops from constants and the step's inputs that get no
    gradient (not parameters or buffers): attention masks built from a padding mask, positions.

    # NOTE [values made from the inputs alone]
    Eager autograd often never makes them: HF's decoders skip an all-ones padding mask in eager
    and pass ``is_causal=True`` to SDPA, but under Dynamo the mask is a traced tensor that cannot
    be read, so the captured graph builds a (B, 1, L, L) mask and each layer's SDPA converts it
    to a float mask it saves for its backward: 4 bytes x B x L² per layer that plain PyTorch never
    holds (Llama, width 256, batch 8 x 128, two layers: 1 MiB). Made again in the backward from
    the inputs, which the caller holds anyway, they cost a transient per layer instead; no
    parameter, buffer or compute-heavy op is involved, so this adds no FLOPs that matter.
    """
    free = {
        p
        for i, (p, grad) in enumerate(zip(jg.primals, jg.grads_by_primal, strict=False))
        if grad is None and i not in jg.static_inputs
    }
    derived: set[fx.Node] = set()
    for n in jg.forward:
        if n.op != "call_function" or jg.must_save(n) or is_compute_heavy(n):
            continue
        if all(a in free or a in derived or is_sym_node(a) for a in jg.inputs[n]):
            derived.add(n)
    return derived


def keep_heavy(jg: JointGraph, *, small_fraction: float = 0.01) -> set[fx.Node]:
    """Keep outputs of compute-heavy ops, and tensors too small to be worth recomputing.

    "Small" is relative (under ``small_fraction`` of the largest forward value), so BatchNorm's
    per-channel statistics are kept on any model size while activations are not.
    """
    cands = _candidates(jg)
    largest = max((jg.bytes_of([n]) for n in cands), default=0)
    kept = always_kept(jg)
    for n in cands:
        src = n.args[0] if jg.is_getitem(n) and isinstance(n.args[0], fx.Node) else n
        if is_compute_heavy(src) or jg.bytes_of([n]) <= small_fraction * largest:
            kept.add(n)
    return jg.saved_needed(kept)


def keep_marked(jg: JointGraph) -> set[fx.Node]:
    """Keep exactly the values marked with ``memfit.mark`` (plus random ops and outputs)."""
    kept = always_kept(jg) | {n for n in jg.forward if n.meta.get(MARK_META)}
    return jg.saved_needed(kept)


#: A module path's first index into a container (``layers.3``, ``h[3]``): a repeated block.
_BLOCK_INDEX = re.compile(r"(\.\d+|\[\d+\])(?=\.|\[|$)")


def _block(node: fx.Node) -> str | None:
    """The repeated block (an element of a ``ModuleList`` or ``Sequential``: a transformer
    layer) the outermost of which ``node`` was traced in, by its module path; None outside."""
    for entry in (node.meta.get("nn_module_stack") or {}).values():
        path = entry[0] if isinstance(entry, tuple) else entry
        match = _BLOCK_INDEX.search(str(path))
        if match:
            return str(path)[: match.end()]
    return None


def keep_blocks(jg: JointGraph) -> set[fx.Node] | None:
    """The plan a user makes by hand: ``torch.utils.checkpoint`` around every repeated block
    (Hugging Face's ``gradient_checkpointing_enable()``, per-layer checkpointing in torchtitan).
    Values that cross from one block to another or out of it (its inputs and outputs) are kept,
    and so is everything outside the blocks; what a block computes inside is recomputed.

    Why a candidate of its own: on T5 the cut heuristic and the segment programme found no plan
    as low as per-block checkpointing (memfit ``"memory"`` 79.4 MB, HF gradient checkpointing
    67.8 MB, CPU fp32): T5's position bias and the encoder's output are read by every block, so
    no cut in the forward order is small. The module structure names the blocks directly. None
    when the graph has fewer than two blocks."""
    block = {n: _block(n) for n in jg.forward}
    if len({b for b in block.values() if b is not None}) < 2:
        return None
    kept = set()
    for n in _candidates(jg):
        b = block[n]
        if b is None or any(block.get(u, b) != b for u in n.users if u in block):
            kept.add(n)
    return jg.saved_needed(kept | always_kept(jg))


def keep_min_peak(jg: JointGraph, *, grid: int = 24) -> set[fx.Node]:
    """Least simulated peak over cut plans of every segment size (see module docstring)."""
    fwd = [n for n in jg.forward]
    if not fwd:
        return keep_all(jg)
    pos = {n: i for i, n in enumerate(fwd)}
    own = jg.own_bytes()
    primal_keys = {k for p in jg.primals for k in jg.storages[p]}

    # A value crosses position p when it is produced at or before p and read in forward after p.
    crossing: list[tuple[int, int, fx.Node]] = []
    for n in _candidates(jg):
        readers = [pos[u] for u in jg.users_in_forward(n) if u in pos]
        if readers and max(readers) > pos[n]:
            crossing.append((pos[n], max(readers), n))
    # Frontier bytes per position, counting each storage once over its whole crossing span.
    span: dict[object, tuple[int, int]] = {}
    for start, end, n in crossing:
        for key in jg.storages[n]:
            if key in primal_keys:
                continue
            lo, hi = span.get(key, (start, end))
            span[key] = (min(lo, start), max(hi, end))
    diff = [0] * (len(fwd) + 1)
    for key, (lo, hi) in span.items():
        diff[lo] += jg.storage_bytes[key]
        diff[hi] -= jg.storage_bytes[key]
    frontier = []
    acc = 0
    for d in diff[:-1]:
        acc += d
        frontier.append(acc)

    base = always_kept(jg)

    def kept_for(cuts: list[int]) -> set[fx.Node]:
        kept = set(base)
        for start, end, n in crossing:
            i = bisect.bisect_left(cuts, start)
            if i < len(cuts) and cuts[i] < end:
                kept.add(n)
        return kept

    prefix: list[int] = []
    running = 0
    for n in fwd:
        running += own.get(n, 0)
        prefix.append(running)

    def cuts_for(segment: float) -> list[int]:
        cuts: list[int] = []
        last, base_bytes = -1, 0
        while True:
            end = bisect.bisect_left(prefix, base_bytes + segment, lo=last + 1)
            if end >= len(fwd) - 1:
                return cuts
            lo = bisect.bisect_left(prefix, base_bytes + segment / 2, lo=last + 1)
            best = min(range(lo, end + 1), key=lambda p: (frontier[p], -p))
            cuts.append(best)
            last, base_bytes = best, prefix[best]

    total = sum(own.values())
    largest = max(own.values(), default=0)
    candidates: list[set[fx.Node]] = [keep_all(jg), jg.saved_needed(base)]
    if total <= largest or largest <= 0:
        return _best(jg, candidates)
    # Segment sizes on a geometric grid from one op's output to the whole forward, then a finer
    # grid around the best of them: the peak is far from convex in the segment size.
    sizes = _geometric(largest, total, grid)
    coarse = [jg.saved_needed(kept_for(cuts_for(size))) for size in sizes]
    best = _best(jg, candidates + coarse)
    i = next((k for k, c in enumerate(coarse) if c == best), None)
    if i is None:
        return best
    size_lo, size_hi = sizes[max(i - 1, 0)], sizes[min(i + 1, len(sizes) - 1)]
    fine = [
        jg.saved_needed(kept_for(cuts_for(size)))
        for size in _geometric(size_lo, size_hi, grid // 2)
    ]
    return _best(jg, [best] + fine)


def _geometric(lo: float, hi: float, steps: int) -> list[float]:
    if hi <= lo or steps < 2:
        return [lo]
    ratio = (hi / lo) ** (1 / (steps - 1))
    return [lo * ratio**k for k in range(steps)]


def _best(jg: JointGraph, candidates: list[set[fx.Node]]) -> set[fx.Node]:
    """The candidate with the least simulated peak; ties go to the one keeping more (faster)."""
    scored: list[tuple[int, int, int, set[fx.Node]]] = []
    seen: set[frozenset[fx.Node]] = set()
    for kept in candidates:
        key = frozenset(kept)
        if key in seen:
            continue
        seen.add(key)
        sim = simulate_step(jg, kept)
        scored.append((sim.peak_bytes, -sim.saved_bytes, len(scored), kept))
    scored.sort(key=lambda t: t[:3])
    return scored[0][3]
