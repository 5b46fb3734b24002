"""The keep-set rules read the model's structure as written (``planning.keep_rules``).

What each rule keeps, measured on real steps, is tested per policy in ``tests/test_policies.py``;
here, the pure parts of the rules.
"""

from __future__ import annotations

from memfit.planning.keep_rules import _block


def test_blocks_are_read_from_module_paths() -> None:
    class Node:
        def __init__(self, *paths: str) -> None:
            self.meta = {"nn_module_stack": {str(i): (p, object) for i, p in enumerate(paths)}}

    assert _block(Node("L['self'].model", "L['self'].model.layers.3", "x.layers.3.mlp")) == (
        "L['self'].model.layers.3"
    )
    assert _block(Node("L['self'].h[2]", "L['self'].h[2].attn")) == "L['self'].h[2]"
    assert _block(Node("L['self'].head")) is None
    assert _block(Node()) is None
