"""What the attention pass reports: the sites it found and what it did with each.

Part of ``memfit.capture.attention``: see its docstring.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ADDITIVE", "ATTENTION_MODES", "MEMFIT", "SDPA", "AttentionSite"]

#: ``attention=`` values: "auto" rewrites every site found, "off" leaves the graph alone.
ATTENTION_MODES = ("auto", "off")
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
