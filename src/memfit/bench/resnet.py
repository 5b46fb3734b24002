"""The CIFAR-shaped ResNet that ``memfit demo``, the depth sweep and the test zoo all train.

Why one shared definition: the README's figures, the benchmark tables and the tests should describe
one architecture, so it lives in the installed package (the demo and ``memfit bench`` need nothing
outside it) rather than in the tests.

It is a pre-activation ResNet v2 (He et al. 2016, "Identity Mappings in Deep Residual Networks")
with BatchNorm, the kind of model gradient checkpointing is usually sold on. Its residual blocks
form one ``nn.Sequential`` (``model.blocks``) so that
``torch.utils.checkpoint.checkpoint_sequential`` can be applied to them for comparison.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CifarResNet", "PreActBlock", "cifar_resnet"]


class PreActBlock(nn.Module):
    """BN-ReLU-conv3x3, BN-ReLU-conv3x3, plus identity or 1x1-projection shortcut."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(c_in)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, stride=1, padding=1, bias=False)
        self.shortcut: nn.Module | None = None
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(x))
        skip = x if self.shortcut is None else self.shortcut(out)
        out = self.conv1(out)
        out = self.conv2(F.relu(self.bn2(out)))
        return out + skip


class CifarResNet(nn.Module):
    """Pre-activation CIFAR ResNet: ``stem`` -> ``blocks`` (one ``nn.Sequential``) -> ``head``."""

    def __init__(self, blocks_per_stage: int, width: int = 16, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1, bias=False)
        blocks: list[nn.Module] = []
        c_in = width
        for stage in range(3):
            c_out = width * 2**stage
            for b in range(blocks_per_stage):
                stride = 2 if (stage > 0 and b == 0) else 1
                blocks.append(PreActBlock(c_in, c_out, stride))
                c_in = c_out
        self.blocks = nn.Sequential(*blocks)
        self.bn = nn.BatchNorm2d(c_in)
        self.fc = nn.Linear(c_in, num_classes)

    def head(self, features: torch.Tensor) -> torch.Tensor:
        """Everything after the residual blocks: BN-ReLU, global average pool, linear."""
        out = F.relu(self.bn(features))
        return self.fc(F.adaptive_avg_pool2d(out, 1).flatten(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))


def cifar_resnet(blocks_per_stage: int, width: int = 16, num_classes: int = 10) -> CifarResNet:
    """Pre-activation CIFAR ResNet with ``3 * blocks_per_stage`` residual blocks.

    That is ``6 * blocks_per_stage + 2`` layers: ``cifar_resnet(3)`` is ResNet-20,
    ``cifar_resnet(18)`` ResNet-110. Stages have ``width``, ``2 * width`` and ``4 * width``
    channels at 32x32, 16x16 and 8x8 for a 3x32x32 input. Returned in training mode; the weights
    come from the global RNG, so seed it first for reproducibility.
    """
    return CifarResNet(blocks_per_stage, width, num_classes).train()
