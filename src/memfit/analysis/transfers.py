"""When offloaded values move, and what the moves cost: the transfer link as two queues.

Why a schedule and not just "offload it": an offloaded value saves memory only between the moment
its copy out has completed and the moment its copy back starts, and it saves time only if both
copies hide behind compute. Both moments are decided here, once, from the very orders the executor
runs (the forward graph in joint order, the backward in ``order_backward``'s order), and written
into the plan as node names:

* ``wait_after``: the forward node after which the executor waits for the copy out and drops the
  device copy. It is the first node whose estimated end is past the copy's completion, and never
  before the value's last forward reader (the value is alive until then anyway).
* ``prefetch_before``: the backward node before which the copy back starts (its buffer is
  allocated then). It is the latest node that leaves the copy its transfer time before the
  value's first backward reader.

The link is two FIFO queues, out and in, each with a bandwidth (``Link``, measured once per
device and destination by ``execution.offload``). Copies in a queue run one after another in
issue order. Node times are ``analysis.cost.node_seconds`` estimates, so the stall this predicts is
an estimate; the memory it implies is not: the executor places the waits and prefetches at the
named nodes whatever the timing, so the simulator's peak is exactly what runs, and a slower link
only costs time (the wait blocks).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from memfit.analysis.graph import JointGraph

__all__ = [
    "Link",
    "Transfer",
    "TransferSchedule",
    "offloadable",
    "schedule_transfers",
    "value_bytes",
]


@dataclass(frozen=True)
class Link:
    """The copies out (device to host or disk) and back in, as measured.

    ``out_bytes_per_s``/``in_bytes_per_s`` and ``latency_s`` (per copy) give a copy's duration.
    ``overlap`` is the fraction of that duration that runs beside compute: 1 for a GPU's copy
    engines; on a CPU, where the copies run on the cores that compute, it is measured and can be
    near 0 when the compute already uses every core. The rest of each copy takes compute's own
    time (a stall wherever it is issued).
    """

    out_bytes_per_s: float
    in_bytes_per_s: float
    latency_s: float = 0.0
    overlap: float = 1.0

    def __post_init__(self) -> None:
        if not (self.out_bytes_per_s > 0 and self.in_bytes_per_s > 0):
            raise ValueError(f"link bandwidths must be positive, got {self}")
        if not (self.latency_s >= 0 and 0.0 <= self.overlap <= 1.0):
            raise ValueError(f"link latency must be >= 0 and overlap in [0, 1], got {self}")

    def out_seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.out_bytes_per_s

    def in_seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.in_bytes_per_s

    def split(self, seconds: float) -> tuple[float, float]:
        """``seconds`` of copying as (taken from compute, running beside it)."""
        beside = seconds * self.overlap
        return seconds - beside, beside


@dataclass(frozen=True)
class Transfer:
    """One offloaded value: its bytes and the two nodes that bound its absence from the device."""

    value: fx.Node
    nbytes: int
    wait_after: fx.Node
    prefetch_before: fx.Node


@dataclass(frozen=True)
class TransferSchedule:
    """Transfers in the order they are issued, and the time they are predicted to cost."""

    transfers: tuple[Transfer, ...]
    #: seconds the link is busy, out and in together
    transfer_seconds: float
    #: seconds compute is predicted to wait for a copy (forward waits plus backward reloads)
    stall_seconds: float
    #: estimated compute seconds of the step the transfers overlap (forward + backward)
    compute_seconds: float

    @property
    def offloaded_bytes(self) -> int:
        return sum(t.nbytes for t in self.transfers)


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers exactly ``numel`` consecutive elements of its storage (any order)."""
    dims = sorted(
        ((stride, size) for size, stride in zip(t.shape, t.stride()) if size != 1),
        key=lambda d: d[0],
    )
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def value_bytes(jg: JointGraph, value: fx.Node) -> int:
    """Bytes an offload of ``value`` moves: its one storage (``offloadable`` values have one),
    as the tensor holds them (``storage_bytes`` is what the allocator frees: on CUDA rounded up
    to whole 512-byte blocks, ``analysis.graph.allocated_bytes``)."""
    return jg.sizes(jg.storage_sizes[jg.storages[value][0]])


def offloadable(jg: JointGraph, saved: Iterable[fx.Node], *, min_bytes: int = 0) -> list[fx.Node]:
    """The saved values an offload can actually free, in forward order.

    A value qualifies when it alone holds its storage among the saved values, the forward outputs
    and the step's inputs (offloading one alias of a storage another saved value keeps would free
    nothing: views are offloaded once, through the one value that owns the storage), when it
    covers its storage exactly (so the copy moves exactly the bytes it frees), and when it has at
    least ``min_bytes``.
    """
    saved_list = [n for n in saved if n.op != "placeholder"]
    holders: dict[int, int] = {}
    blocked = set(jg.primal_keys) | {k for n in jg.fwd_outputs for k in jg.storages[n]}
    for n in saved_list:
        for k in jg.storages[n]:
            holders[k] = holders.get(k, 0) + 1
    found = []
    for n in saved_list:
        keys = jg.storages[n]
        val = n.meta.get("val")
        if len(keys) != 1 or not isinstance(val, torch.Tensor) or n in jg.fwd_outputs:
            continue
        (key,) = keys
        nbytes = value_bytes(jg, n)  # the tensor's bytes, not the allocator's block
        if key in blocked or holders[key] != 1 or nbytes < max(min_bytes, 1):
            continue
        if val.numel() * val.element_size() != nbytes or val.storage_offset() != 0:
            continue
        if not _dense(val):
            continue
        found.append(n)
    return sorted(found, key=jg.index.__getitem__)


def schedule_transfers(
    jg: JointGraph,
    forward: Sequence[fx.Node],
    backward: Sequence[fx.Node],
    values: Iterable[fx.Node],
    link: Link,
    seconds: dict[fx.Node, float],
) -> TransferSchedule:
    """Place the copy-out wait and the prefetch of each value in ``values``; predict the stall.

    ``forward`` and ``backward`` are the orders the step runs (``simulate_step``'s), ``seconds``
    each node's estimated time.
    """
    chosen = set(values)
    if not chosen:
        return TransferSchedule((), 0.0, 0.0, _total(forward, backward, seconds))
    fwd_pos = {n: i for i, n in enumerate(forward)}

    def nbytes(v: fx.Node) -> int:
        return value_bytes(jg, v)

    order = sorted(chosen, key=lambda v: fwd_pos.get(v, -1))
    wait_pos, stall = _place_waits(jg, forward, order, fwd_pos, link, seconds, nbytes)
    first_reader, prefetch_pos = _place_prefetches(jg, backward, chosen, link, seconds, nbytes)
    stall = _backward_stall(backward, first_reader, prefetch_pos, link, seconds, nbytes, stall)
    transfers = tuple(
        Transfer(
            value=v,
            nbytes=nbytes(v),
            wait_after=forward[wait_pos[v]],
            prefetch_before=backward[prefetch_pos[v]],
        )
        for v in order
        if v in prefetch_pos  # a saved value no backward node reads needs no transfer back
    )
    return TransferSchedule(
        transfers=transfers,
        transfer_seconds=sum(
            link.out_seconds(t.nbytes) + link.in_seconds(t.nbytes) for t in transfers
        ),
        stall_seconds=stall,
        compute_seconds=_total(forward, backward, seconds),
    )


def _place_waits(
    jg: JointGraph,
    forward: Sequence[fx.Node],
    order: list[fx.Node],
    fwd_pos: dict[fx.Node, int],
    link: Link,
    seconds: dict[fx.Node, float],
    nbytes: Callable[[fx.Node], int],
) -> tuple[dict[fx.Node, int], float]:
    """Where in ``forward`` each copy out of ``order`` is waited for, and the forward's stall.

    A first run of the forward without waits says when each copy out completes; each wait goes
    after the first node that ends by then (and not before the value's last reader)."""
    last_reader = {v: fwd_pos.get(v, -1) for v in order}
    for i, n in enumerate(forward):
        for a in jg.inputs[n]:
            if a in last_reader:
                last_reader[a] = i
    done_at, ends, _ = _run_forward(forward, order, fwd_pos, {}, link, seconds, nbytes)
    wait_pos: dict[fx.Node, int] = {}
    for v in order:
        pos = min(bisect.bisect_left(ends, done_at[v]), len(forward) - 1)
        wait_pos[v] = max(pos, last_reader[v])
    waits_at: dict[int, list[fx.Node]] = {}
    for v, pos in wait_pos.items():
        waits_at.setdefault(pos, []).append(v)
    _, _, stall = _run_forward(forward, order, fwd_pos, waits_at, link, seconds, nbytes)
    return wait_pos, stall


def _place_prefetches(
    jg: JointGraph,
    backward: Sequence[fx.Node],
    chosen: set[fx.Node],
    link: Link,
    seconds: dict[fx.Node, float],
    nbytes: Callable[[fx.Node], int],
) -> tuple[dict[fx.Node, int], dict[fx.Node, int]]:
    """Each chosen value's first reader in ``backward`` and where its copy back is issued: at
    the latest node that leaves it its transfer time before that reader (by the estimated,
    unstalled clock). A value no backward node reads has neither."""
    starts: list[float] = []
    clock = 0.0
    for n in backward:
        starts.append(clock)
        clock += seconds.get(n, 0.0)
    first_reader: dict[fx.Node, int] = {}
    for i, n in enumerate(backward):
        for a in jg.inputs[n]:
            if a in chosen and a not in first_reader:
                first_reader[a] = i
    prefetch_pos: dict[fx.Node, int] = {}
    for v, r in first_reader.items():
        # Only the part of the copy that runs beside compute needs a head start: the rest takes
        # compute's own time when the copy is issued, so an earlier start only holds memory.
        wanted = starts[r] - link.split(link.in_seconds(nbytes(v)))[1]
        prefetch_pos[v] = max(bisect.bisect_right(starts, wanted, 0, r + 1) - 1, 0)
    return first_reader, prefetch_pos


def _backward_stall(
    backward: Sequence[fx.Node],
    first_reader: dict[fx.Node, int],
    prefetch_pos: dict[fx.Node, int],
    link: Link,
    seconds: dict[fx.Node, float],
    nbytes: Callable[[fx.Node], int],
    stall: float,
) -> float:
    """``stall`` (the forward's) plus the backward's, running the copies back in issue order."""
    issued = sorted(first_reader, key=lambda v: (prefetch_pos[v], first_reader[v]))
    issue_at: dict[int, list[fx.Node]] = {}
    for v in issued:
        issue_at.setdefault(prefetch_pos[v], []).append(v)
    readers_at: dict[int, list[fx.Node]] = {}
    for v, r in first_reader.items():
        readers_at.setdefault(r, []).append(v)
    arrived: dict[fx.Node, float] = {}
    free = 0.0
    clock = 0.0
    for i, n in enumerate(backward):
        for v in issue_at.get(i, ()):
            took, free = _issue(link, link.in_seconds(nbytes(v)), clock, free)
            clock += took
            stall += took
            arrived[v] = free
        for v in readers_at.get(i, ()):
            if arrived[v] > clock:
                stall += arrived[v] - clock
                clock = arrived[v]
        clock += seconds.get(n, 0.0)
    return stall


def _issue(link: Link, copy_s: float, clock: float, free: float) -> tuple[float, float]:
    """A copy of ``copy_s`` seconds issued at ``clock`` on a queue that is free from ``free``:
    the seconds it takes from compute, and when it completes."""
    took, beside = link.split(copy_s)
    return took, max(clock + took, free) + beside


def _run_forward(
    forward: Sequence[fx.Node],
    order: Sequence[fx.Node],
    fwd_pos: dict[fx.Node, int],
    waits_at: dict[int, list[fx.Node]],
    link: Link,
    seconds: dict[fx.Node, float],
    nbytes: Callable[[fx.Node], int],
) -> tuple[dict[fx.Node, float], list[float], float]:
    """The forward's clock with copies out issued as values are produced and ``waits_at``
    blocking: when each copy completes, when each node ends, and the seconds compute waited."""
    produced: dict[int, list[fx.Node]] = {}
    for v in order:
        produced.setdefault(fwd_pos[v], []).append(v)
    done_at: dict[fx.Node, float] = {}
    ends: list[float] = []
    clock = free = stall = 0.0
    for i, n in enumerate(forward):
        clock += seconds.get(n, 0.0)
        for v in produced.get(i, ()):
            took, free = _issue(link, link.out_seconds(nbytes(v)), clock, free)
            clock += took
            stall += took
            done_at[v] = free
        ends.append(clock)
        for v in waits_at.get(i, ()):
            if done_at[v] > clock:
                stall += done_at[v] - clock
                clock = done_at[v]
    return done_at, ends, stall


def _total(
    forward: Sequence[fx.Node], backward: Sequence[fx.Node], seconds: dict[fx.Node, float]
) -> float:
    return float(sum(seconds.get(n, 0.0) for n in [*forward, *backward]))
