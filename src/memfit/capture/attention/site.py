"""What the attention pass reports: the sites it found and what it did with each.

Part of ``memfit.capture.attention``: see its docstring.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.choice import Choice

__all__ = ["ADDITIVE", "MEMFIT", "SDPA", "Attention", "AttentionSite"]


class Attention(Choice):
    """What memfit does with the attention it finds in a model (``Options.attention``)."""

    #: rewrite it to a kernel that keeps no sequence-length-squared tensor (fused SDPA where it
    #: applies, memfit's chunked kernel otherwise)
    AUTO = "auto"
    #: leave attention as written
    OFF = "off"


#: Kernel names in ``AttentionSite.kernel``.
SDPA, MEMFIT, ADDITIVE = "sdpa", "memfit", "memfit-additive"


@dataclass(frozen=True)
class AttentionSite:
    """One attention found in a captured graph, and what memfit did with it.

    ``kernel`` is ``"sdpa"`` (PyTorch's fused kernel), ``"memfit"`` (memfit's chunked kernel) or
    None when the site was left as the model wrote it; ``reason`` says why in either case.
    """

    where: str
    kernel: str | None
    reason: str
    scores_shape: tuple[int, ...]
    dropout_p: float = 0.0

    def __str__(self) -> str:
        shape = "x".join(str(s) for s in self.scores_shape)
        done = f"-> {self.kernel}" if self.kernel else "left alone"
        return f"{self.where}: [{shape}] scores {done} ({self.reason})"
