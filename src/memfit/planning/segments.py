"""Least recompute time under a byte budget: dynamic programming over segments of the forward.

Why segments. Exact rematerialisation (Checkmate) is an MILP over every value and every step of
the schedule: hours of solver time on real graphs. Any graph, though, becomes a chain once it is
cut at positions of its topological order: what must be kept at a cut is its *frontier*, every
value produced before it and read after it (a U-Net's long skips are frontier values of many cuts;
no single-node separator is needed). Between two chosen cuts, a segment runs in one of three ways:

* ``store``     — keep everything its backward reads (plain autograd; no recompute);
* ``heavy``     — keep matmul/conv/attention outputs and small tensors, recompute the cheap ops;
* ``recompute`` — keep only what crosses its end cut, recompute the rest just before its backward.

Memory model (Chen et al.'s, per segment): the backward runs segments last to first, and while
segment j's gradients are computed, what segments 1..j keep is alive, plus segment j's recomputed
values, plus gradient temporaries ``G``:  peak = max_j (Σ_{i≤j} kept_i + transient_j) + G.
With kept bytes quantised into buckets, "cost so far for each prefix of kept bytes" is a table, and
a dynamic programme over (cut, kept bytes) finds the least total recompute time whose modelled peak
fits the budget, exactly within this family of plans, in O(K² · buckets) numpy work for K cuts.

The model steers; it does not decide. Every plan the programme returns is replayed by the memory
simulator (``analysis.simulate``), and only simulated peaks are reported or compared with a
budget (see ``planning.frontier``).
"""

from __future__ import annotations

import numpy as np
import torch.fx as fx

from memfit.analysis.cost import is_compute_heavy, node_seconds
from memfit.analysis.graph import JointGraph

__all__ = ["SegmentModel", "SEGMENT_KINDS"]

#: How a segment runs (see above), indexed by the programme's integer segment kind.
SEGMENT_KINDS = ("store", "heavy", "recompute")

_INF = np.inf


class SegmentModel:
    """Per-segment kept bytes, transient bytes and recompute time of one joint graph.

    ``cuts`` are positions in ``jg.forward`` chosen where the frontier is smallest within windows
    of equal forward bytes (at most ``max_cuts`` of them); segment (cuts[i], cuts[j]] covers the
    forward nodes after cut i up to and including cut j.
    """

    def __init__(
        self,
        jg: JointGraph,
        always_kept: set[fx.Node],
        bw_read: set[fx.Node],
        *,
        seconds: dict[fx.Node, float] | None = None,
        max_cuts: int = 64,
        buckets: int = 192,
        small_fraction: float = 0.01,
    ) -> None:
        self.jg = jg
        fwd = list(jg.forward)
        self.fwd = fwd
        pos = {n: i for i, n in enumerate(fwd)}
        self.pos = pos
        n_fwd = len(fwd)
        primal_keys = {k for p in jg.primals for k in jg.storages[p]}

        last_read = _last_read(jg, fwd, pos)
        need = _needed_if_recomputed(bw_read, pos, n_fwd)
        node_secs = np.array(
            [
                seconds[n]
                if seconds is not None
                else node_seconds(n, jg.sizes, jg.fused_elementwise)
                for n in fwd
            ],
            dtype=np.float64,
        )
        always = np.array([n in always_kept for n in fwd], dtype=bool)
        heavy = _heavy(jg, fwd, primal_keys, small_fraction)
        bw = np.array([n in bw_read for n in fwd], dtype=bool)

        # Storages: born at the first forward node producing them; they cross a cut if any node
        # viewing them is read after it; "backward reads" / "heavy" if any such node is.
        birth: dict[object, int] = {}
        s_last: dict[object, int] = {}
        s_bw: dict[object, bool] = {}
        s_heavy: dict[object, bool] = {}
        s_always: dict[object, bool] = {}
        for i, n in enumerate(fwd):
            for k in jg.storages[n]:
                if k in primal_keys:
                    continue
                birth.setdefault(k, i)
                s_last[k] = max(s_last.get(k, -1), int(last_read[i]))
                s_bw[k] = s_bw.get(k, False) or bool(bw[i])
                s_heavy[k] = s_heavy.get(k, False) or bool(heavy[i] and need[i])
                s_always[k] = s_always.get(k, False) or bool(always[i])
        keys = list(birth)
        self.s_birth = np.array([birth[k] for k in keys], dtype=np.int64)
        self.s_last = np.array([s_last[k] for k in keys], dtype=np.int64)
        self.s_bytes = np.array([jg.storage_bytes[k] for k in keys], dtype=np.float64)
        self.s_bw = np.array([s_bw[k] for k in keys], dtype=bool)
        self.s_heavy = np.array([s_heavy[k] for k in keys], dtype=bool)
        self.s_always = np.array([s_always[k] for k in keys], dtype=bool)
        self.n_last = last_read
        self.n_need = need & ~always
        self.n_heavy = heavy
        self.n_seconds = node_secs
        self.cuts = self._choose_cuts(max_cuts)
        self.buckets = buckets
        self._tables()

    # ---- cut positions -------------------------------------------------------------------------

    def _frontier(self) -> np.ndarray:
        """Bytes crossing each position: born at or before it, read in forward after it."""
        n_fwd = len(self.fwd)
        diff = np.zeros(n_fwd + 1)
        crossing = self.s_last > self.s_birth
        np.add.at(diff, self.s_birth[crossing], self.s_bytes[crossing])
        np.add.at(diff, self.s_last[crossing], -self.s_bytes[crossing])
        return np.cumsum(diff)[:n_fwd]

    def _choose_cuts(self, max_cuts: int) -> list[int]:
        """End positions of K windows of about equal forward bytes, each at its smallest frontier.

        Within a window the latest of the smallest-frontier positions wins (the end of a block
        rather than its start). The last cut is always the end of the forward.
        """
        n_fwd = len(self.fwd)
        if n_fwd == 0:
            return []
        if n_fwd <= max_cuts:
            return list(range(n_fwd))
        frontier = self._frontier()
        own = np.zeros(n_fwd)
        np.add.at(own, self.s_birth, self.s_bytes)
        prefix = np.cumsum(own)
        if prefix[-1] <= 0:
            prefix = np.arange(1, n_fwd + 1, dtype=np.float64)
        total = prefix[-1]
        cuts: list[int] = []
        lo = 0
        for w in range(1, max_cuts):
            hi = int(np.searchsorted(prefix, total * w / max_cuts, side="left"))
            hi = min(max(hi, lo), n_fwd - 2)
            if hi < lo:
                continue
            window = frontier[lo : hi + 1]
            best = lo + int(len(window) - 1 - np.argmin(window[::-1]))
            cuts.append(best)
            lo = best + 1
        cuts.append(n_fwd - 1)
        return cuts

    # ---- per-segment tables --------------------------------------------------------------------

    def _tables(self) -> None:
        """kept[m][i, j], transient[m][i, j], seconds[m][i, j] for segments (cut i, cut j]."""
        cuts = self.cuts
        k = len(cuts)
        bounds = np.array([-1] + cuts, dtype=np.int64)  # bounds[i]: cut before window i+1
        # window of each storage / node birth: 1..k
        s_win = np.searchsorted(bounds[1:], self.s_birth, side="left") + 1
        n_win = np.searchsorted(bounds[1:], np.arange(len(self.fwd)), side="left") + 1
        shape = (len(SEGMENT_KINDS), k + 1, k + 1)
        kept = np.full(shape, _INF)
        trans = np.full(shape, _INF)
        secs = np.full(shape, _INF)
        for j in range(1, k + 1):
            end = bounds[j]
            s_in = s_win <= j
            s_cross = self.s_last > end
            base = self.s_always | s_cross
            s_keep = [base | self.s_bw, base | self.s_heavy, base]
            s_tran = [np.zeros_like(base), self.s_bw & ~s_keep[1], self.s_bw & ~base]
            n_in = n_win <= j
            n_cross = self.n_last > end
            n_rec = [
                np.zeros_like(n_cross),
                self.n_need & ~n_cross & ~self.n_heavy,
                self.n_need & ~n_cross,
            ]
            for m in range(len(SEGMENT_KINDS)):
                kw = np.bincount(s_win[s_in], self.s_bytes[s_in] * s_keep[m][s_in], minlength=k + 1)
                tw = np.bincount(s_win[s_in], self.s_bytes[s_in] * s_tran[m][s_in], minlength=k + 1)
                cw = np.bincount(
                    n_win[n_in], self.n_seconds[n_in] * n_rec[m][n_in], minlength=k + 1
                )
                # segment (cut i, cut j] = windows i+1..j: suffix sums over windows ≤ j
                for table, w in ((kept, kw), (trans, tw), (secs, cw)):
                    suffix = np.cumsum(w[: j + 1][::-1])[::-1]  # suffix[i] = Σ w[i..j]
                    table[m, :j, j] = suffix[1 : j + 1]
        self.kept, self.trans, self.secs = kept, trans, secs

    # ---- the dynamic programme -----------------------------------------------------------------

    @property
    def store_all_bytes(self) -> float:
        """Kept bytes of storing everything: the most any plan of this family keeps."""
        k = len(self.cuts)
        return float(self.kept[0, 0, k]) if k else 0.0

    def quantized(self) -> tuple[float, np.ndarray, np.ndarray]:
        """(bytes per bucket, kept bytes in whole buckets, transient bytes in buckets)."""
        q = max(self.store_all_bytes, 1.0) / (self.buckets - 1)
        return q, np.rint(self.kept / q), self.trans / q

    def solve(self, budget: float) -> list[tuple[int, int, int]] | None:
        """Segments (start cut, end cut, mode) of least recompute time with modelled peak ≤ budget.

        ``budget`` excludes the gradient temporaries (the caller subtracts them). Returns None when
        no plan of this family fits.
        """
        k = len(self.cuts)
        if k == 0:
            return []
        q, kept_b, trans_b = self.quantized()
        m_count = self.buckets + k + 1  # room for rounding up to half a bucket per segment
        limit = budget / q
        f = np.full((k + 1, m_count), _INF)
        f[0, 0] = 0.0
        choice_from = np.full((k + 1, m_count), -1, dtype=np.int64)
        choice_mode = np.full((k + 1, m_count), -1, dtype=np.int64)
        grid = np.arange(m_count)
        for j in range(1, k + 1):
            best = np.full(m_count, _INF)
            best_from = np.full(m_count, -1, dtype=np.int64)
            best_mode = np.full(m_count, -1, dtype=np.int64)
            for m in range(len(SEGMENT_KINDS)):
                kb = kept_b[m, :j, j]  # (j,)
                # segments that cannot fit on their own are never worth a look
                ok = np.isfinite(kb) & (kb + trans_b[m, :j, j] <= limit)
                if not ok.any():
                    continue
                starts = np.nonzero(ok)[0]
                kb = kb[starts].astype(np.int64)
                tb = trans_b[m, starts, j]
                cost = self.secs[m, starts, j]
                src = grid[None, :] - kb[:, None]  # prefix before the segment
                valid = (src >= 0) & ((grid[None, :] + tb[:, None]) <= limit)
                vals = np.where(valid, f[starts[:, None], np.clip(src, 0, None)], _INF)
                vals = vals + cost[:, None]
                arg = np.argmin(vals, axis=0)
                cand = vals[arg, grid]
                better = cand < best
                best = np.where(better, cand, best)
                best_from = np.where(better, starts[arg], best_from)
                best_mode = np.where(better, m, best_mode)
            f[j] = best
            choice_from[j] = best_from
            choice_mode[j] = best_mode
        end = int(np.argmin(f[k]))
        if not np.isfinite(f[k, end]):
            return None
        segments = []
        j, b = k, end
        while j > 0:
            i, m = int(choice_from[j, b]), int(choice_mode[j, b])
            segments.append((i, j, m))
            b -= int(kept_b[m, i, j])
            j = i
        return segments[::-1]

    def kept_nodes(self, segments: list[tuple[int, int, int]]) -> set[fx.Node]:
        """Forward nodes to keep for a solution of ``solve`` (before ``saved_needed``)."""
        bounds = [-1] + self.cuts
        kept: set[fx.Node] = set()
        for i, j, m in segments:
            lo, hi = bounds[i] + 1, bounds[j]
            for p in range(lo, hi + 1):
                n = self.fwd[p]
                if not self.jg.is_tensor_value(n):
                    continue  # multi-output ops are kept through their items
                if SEGMENT_KINDS[m] == "store" or self.n_last[p] > hi:
                    kept.add(n)
                elif SEGMENT_KINDS[m] == "heavy" and self.n_heavy[p]:
                    kept.add(n)
        return kept


def _last_read(jg: JointGraph, fwd: list[fx.Node], pos: dict[fx.Node, int]) -> np.ndarray:
    """The last forward position reading each node's value (-1: read by nothing in forward)."""
    last_read = np.full(len(fwd), -1, dtype=np.int64)
    for i, n in enumerate(fwd):
        readers = [pos[u] for u in jg.users_in_forward(n) if u in pos]
        if readers:
            last_read[i] = max(readers)
    return last_read


def _needed_if_recomputed(bw_read: set[fx.Node], pos: dict[fx.Node, int], n_fwd: int) -> np.ndarray:
    """The forward nodes the backward needs if everything is recomputed: the ancestors of what
    it reads, by forward position."""
    need = np.zeros(n_fwd, dtype=bool)
    stack = [n for n in bw_read if n in pos]
    while stack:
        n = stack.pop()
        if need[pos[n]]:
            continue
        need[pos[n]] = True
        stack.extend(a for a in n.all_input_nodes if a in pos)
    return need


def _heavy(
    jg: JointGraph, fwd: list[fx.Node], primal_keys: set[object], small_fraction: float
) -> np.ndarray:
    """Whether each forward node is compute-heavy (a getitem: its source) or small (at most
    ``small_fraction`` of the largest forward storage): what the "heavy" segment kind keeps."""
    largest = max(
        (jg.storage_bytes[k] for n in fwd for k in jg.storages[n] if k not in primal_keys),
        default=0,
    )
    heavy = np.zeros(len(fwd), dtype=bool)
    for i, n in enumerate(fwd):
        src = n.args[0] if jg.is_getitem(n) and isinstance(n.args[0], fx.Node) else n
        small = jg.is_tensor_value(n) and jg.bytes_of([n]) <= small_fraction * largest
        heavy[i] = is_compute_heavy(src) or small
    return heavy
