"""Why a zoo model's CUDA step measures above its prediction at budget 1.0 (a diagnostic).

Written on the GPU session that found the zoo transformer measuring 1.64x its prediction
(``../results/gpu_h200/rerun/diag_transformer.txt`` is its output there). Prints each op whose
scratch memfit measured (or that failed to run), the plan's predicted forward/backward peaks, the
measured ones (the allocator's counters), and the blocks live at the measured peak with the
native functions that allocated them (``torch.cuda.memory._record_memory_history``).

Run: ``python benchmarks/device/diag_transformer.py [cuda|cpu] [zoo case, default transformer]``
(on CPU only the op-scratch list, the prediction and the measured peak).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

import memfit
from memfit.analysis import op_scratch
from memfit.bench.zoo import case, tree_to


def _traced_scratch() -> None:
    """Print every op-scratch call's result (None: it could not run) and why a run failed."""
    scratch_of_calls, failed = op_scratch._scratch_of_calls, op_scratch._FAILED

    def run(op: Any, args: Any, kwargs: Any) -> Any:
        try:
            return op(*args, **kwargs)
        except Exception as e:
            print("  run failed:", op, type(e).__name__, str(e).splitlines()[0][:200])
            return failed

    def calls(cs: list[Any], dev: torch.device) -> list[int | None]:
        res = scratch_of_calls(cs, dev)
        for c, r in zip(cs, res):
            shapes = [a.shape for a in c.args if isinstance(a, op_scratch._TensorSpec)]
            consts = [a for a in c.args if not isinstance(a, op_scratch._TensorSpec)]
            print(f"  scratch {c.op}: {r}  shapes={shapes} consts={str(consts)[:120]}")
        return res

    op_scratch._run = run
    op_scratch._scratch_of_calls = calls


def _live_at_peak(step: Any) -> None:
    """The blocks live when the step's allocations peaked, largest first, with their allocators."""
    torch.cuda.memory._record_memory_history(
        enabled="all", context="all", stacks="all", max_entries=100000
    )
    step()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    live: dict[int, dict[str, Any]] = {}
    cur = best = 0
    best_live: dict[int, dict[str, Any]] = {}
    for e in snap["device_traces"][0]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            cur += e["size"]
            if cur > best:
                best, best_live = cur, dict(live)
        elif e["action"] == "free_requested" and e["addr"] in live:
            cur -= live.pop(e["addr"])["size"]
    print(f"snapshot peak above start of trace: {best}")
    for e in sorted(best_live.values(), key=lambda e: -e["size"]):
        frames = [
            f.get("name", "")[:90]
            for f in e.get("frames", [])
            if "at::native" in f.get("name", "")
            or "eval_with_key" in f.get("filename", "")
            or "memfit" in f.get("filename", "")
        ][:4]
        print(f"  {e['size']:>9} {frames}")


def main() -> None:
    dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    c = case(sys.argv[2] if len(sys.argv) > 2 else "transformer")
    _traced_scratch()
    args, kwargs = tree_to(c.make_inputs(), dev)
    wrapped = memfit.checkpoint(c.make_model().to(dev), budget=1.0)

    def step() -> None:
        c.loss(wrapped(*args, **kwargs)).backward()

    step()
    wrapped.zero_grad(set_to_none=True)
    plan = wrapped.plan
    for g in plan.parts():
        print(
            f"graph {g.key}: predicted peak {g.predicted_peak_bytes} fwd {g.forward_peak_bytes} "
            f"bwd {g.backward_peak_bytes} fwd_end {g.forward_end_bytes} out {g.output_bytes} "
            f"grads {g.parameter_grad_bytes} outside {g.outside_bytes} kept {g.kept_bytes}"
        )
    print("plan predicted", plan.predicted_peak_bytes, "budget", plan.budget_bytes)
    if dev != "cuda":
        print("measured", memfit.measure(step, device=dev).peak_bytes)
        return
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = c.loss(wrapped(*args, **kwargs))
    torch.cuda.synchronize()
    fwd = torch.cuda.max_memory_allocated() - base
    mid = torch.cuda.memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    torch.cuda.synchronize()
    bwd = torch.cuda.max_memory_allocated() - base
    print(f"measured fwd peak {fwd} after fwd {mid} bwd peak {bwd}")
    wrapped.zero_grad(set_to_none=True)
    del loss
    _live_at_peak(step)


if __name__ == "__main__":
    main()
