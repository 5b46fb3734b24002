"""A plain PyTorch training loop with memfit: one line, and the model is still your model.

    python examples/plain_loop.py

``memfit.checkpoint(model, policy)`` changes the model in place and returns it: the first
training call captures and plans it, every later one runs the plan. Evaluation under
``torch.no_grad()`` runs plain PyTorch. ``memfit.measure`` measures a step's peak exactly.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import memfit


def make_model(depth: int = 8, width: int = 256) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def batches(steps: int, rows: int = 512, width: int = 256) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(rows, width, generator=g), torch.randint(0, 10, (rows,), generator=g))
        for _ in range(steps)
    ]


def train(model: nn.Module, steps: int = 3) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in batches(steps):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def main() -> dict[str, object]:
    model = memfit.checkpoint(make_model(), "memory")  # the one line memfit adds
    losses = train(model)
    x, y = batches(1)[0]
    step = memfit.measure(lambda: F.cross_entropy(model(x), y).backward())
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    return {
        "losses": losses,
        "peak_bytes": step.peak_bytes,
        "predicted_peak_bytes": model.memfit.plan.predicted_peak_bytes,
        "accuracy": accuracy,
    }


if __name__ == "__main__":
    print(main())
