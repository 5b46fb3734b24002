"""Fake tensors as a user's model is planned on them: the mode that makes them, and the test
for one.
"""

from __future__ import annotations

from typing import Any

from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)

__all__ = ["FAKE_VALUE_ERRORS", "FakeTensorMode", "is_fake"]


# ---- fake tensors (checked 2.13.0) ---------------------------------------------------------------
# FakeTensorMode: tensors with shapes, strides, dtypes and a device but no storage, on which ops run
# by their meta functions; on the CPU-only wheel it makes CUDA tensors too. memfit plans a model
# built under torch.device("meta") on them (execution.fake_target). torch documents it ("Fake
# tensor" in the torch.compile docs) but keeps it in a private module.
def is_fake(value: Any) -> bool:
    """Whether ``value`` is a fake tensor (``torch._subclasses.fake_tensor.FakeTensor``), a
    parameter holding one included."""
    return isinstance(value, FakeTensor)


#: What an op raises on fake tensors where its result depends on values they do not have
#: (``.item()``, ``nonzero``, a data-dependent branch in the model's Python).
FAKE_VALUE_ERRORS = (DataDependentOutputException, DynamicOutputShapeException)
