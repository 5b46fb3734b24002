"""A check shared by the tests of memfit.nn's custom ops: their fake kernels, which name only the
arguments they read (see src/memfit/nn/README.md), still see every argument in the schema's order
when the op is called with keywords."""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode


def assert_fake_matches_keyword_call(op: Any, args: tuple[Any, ...]) -> None:
    """Calls ``op`` with ``args`` positionally (the real kernel) and by keyword under
    FakeTensorMode (the fake kernel), and asserts the two return the same shapes and dtypes."""
    names = [a.name for a in op.default._schema.arguments]
    assert len(names) == len(args), f"{op}: schema {names}, {len(args)} arguments given"

    def layout(out: Any) -> list[tuple[torch.Size, torch.dtype]]:
        return [(t.shape, t.dtype) for t in out]

    real = layout(op(*args))
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = layout(op(**dict(zip(names, args))))
    assert fake == real
