"""What each rank runs in the DDP tests (spawned processes import this)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import memfit


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(256, 256), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(256, 4))


def _batches(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    return [torch.randn(8, 256, generator=g) for _ in range(3)]


def accumulate(rank: int, policies: tuple[str | None, ...]) -> dict[str | None, Any]:
    """``_accumulate`` with each policy in turn, and ``_predicted``, in one process group."""
    out: dict[str | None, Any] = {policy: _accumulate(rank, policy) for policy in policies}
    out["predicted"] = _predicted(rank)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))  # once: a second mesh's groups would be measured
    out["fsdp2"] = {mode: _fsdp2(rank, mesh, mode) for mode in ("plain", "memfit")}
    return out


def _fsdp2(rank: int, mesh: Any, mode: str) -> dict[str, Any]:
    """FSDP2 (``fully_shard``, CPU mesh) around blocks memfit is applied to, or plain blocks,
    after a first step: what the forward keeps, then the full gradients and the peak of one step
    from zeroed gradients."""
    from torch.distributed.fsdp import fully_shard

    torch.compiler.reset()
    torch.manual_seed(0)
    blocks: list[nn.Module] = [
        nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256), nn.Tanh())
        for _ in range(3)
    ]
    if mode == "memfit":
        # "speed": its plan is fixed by the graph; "memory"'s frontier search is cut by a time
        # limit, and two ranks planning on two cores sometimes got a plan peaking above plain
        # FSDP2 here (6.44 vs 5.65 MB in 4 of 9 runs)
        blocks = [memfit.checkpoint(b, "speed") for b in blocks]
    model = nn.Sequential(*blocks)
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(128, 256, generator=torch.Generator().manual_seed(rank))
    model(x).square().mean().backward()
    model.zero_grad(set_to_none=True)
    # What the forward leaves for the backward (saved activations and the loss), then the step's
    # peak; each step is the first's again, from zeroed gradients. The least of three forwards:
    # gloo's worker thread sometimes drops the last reference to a block's all-gather buffer, and
    # the profiler does not see a free on that thread, so a forward now and then seems to keep
    # one more block's parameters (1051648 bytes, plain FSDP2's and memfit's alike, on a loaded
    # machine; it failed CI once). A missed free only adds, so the least is the true figure.
    kept = []
    for _ in range(3):
        forward = memfit.measure(lambda: model(x).square().mean())
        forward.result.backward()
        model.zero_grad(set_to_none=True)
        kept.append(forward.end_bytes)
    peak = memfit.measure(lambda: model(x).square().mean().backward()).peak_bytes
    grads = [p.grad.full_tensor() for p in model.parameters()]
    recomputed = sum(len(b.memfit.plan.recomputed) for b in blocks) if mode == "memfit" else 0
    return {
        "grads": grads,
        "kept": min(kept),
        "peak": peak,
        "recomputed": recomputed,
    }


def _predicted(rank: int) -> dict[str, Any]:
    """A synchronised step with Dynamo's DDP optimizer splitting memfit's graph at bucket
    boundaries (small buckets: several graphs): graphs, predicted and measured peak."""
    torch.compiler.reset()
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(512, 512), nn.Tanh())])
    wrapped = memfit.checkpoint(model, "memory")
    ddp = DDP(wrapped, bucket_cap_mb=1)  # about one layer per bucket
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        ddp(x).square().mean().backward()
        model.zero_grad(set_to_none=True)
    measured = memfit.measure(lambda: ddp(x).square().mean().backward()).peak_bytes
    model.zero_grad(set_to_none=True)
    plan = wrapped.memfit.plan
    return {
        "graphs": len(plan.graphs),
        "predicted": plan.predicted_peak_bytes,
        "measured": measured,
    }


def _accumulate(rank: int, policy: str | None) -> dict[str, Any]:
    """Two optimizer steps of DDP with gradient accumulation: two micro-batches under
    ``no_sync`` and a third synchronised; ``policy=None`` is plain DDP. Reports the gradients
    after each step and the peak of each accumulating micro-batch of the second step."""
    model = _mlp()
    inner = model if policy is None else memfit.checkpoint(model, policy)
    ddp = DDP(inner)
    out: dict[str, Any] = {"grads": [], "peaks": []}
    for step in range(2):
        first, second, last = _batches(rank + 2 * step)
        with ddp.no_sync():
            ddp(first).square().mean().backward()
            if step == 1:  # .grad exists: this micro-batch accumulates into it
                m = memfit.measure(lambda x=second: ddp(x).square().mean().backward())
                out["peaks"].append(m.peak_bytes)
            else:
                ddp(second).square().mean().backward()
        ddp(last).square().mean().backward()
        out["grads"].append([p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=step == 0)  # the second step starts from zeroed tensors
    return out
