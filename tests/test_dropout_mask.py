"""attention_dropout_mask draws the keep-mask eager F.dropout draws, and leaves the generator where
eager leaves it, in little memory; it is an op memfit's planner will not recompute."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import memfit
from memfit.nn import attention_dropout_mask
from memfit.nn import dropout_mask as dropout_mask_module
from memfit.nn.bits import packed_width, unpack_bits

SHAPES = [(2, 3, 17, 29), (5, 1030), (13,), (3000, 700)]  # the last spans three draw chunks


def _eager_keep(
    shape: tuple[int, ...], p: float, seed: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    keep = F.dropout(torch.ones(shape, dtype=dtype), p, training=True) != 0
    return keep, torch.get_rng_state()


def _ours(
    shape: tuple[int, ...], p: float, seed: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    packed = attention_dropout_mask(shape, p, "cpu", dtype=dtype)
    assert packed.dtype == torch.uint8
    assert packed.shape == (*shape[:-1], packed_width(shape[-1]))
    return unpack_bits(packed, shape[-1]), torch.get_rng_state()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_mask_and_generator_state_equal_eager_dropout(shape: tuple[int, ...], p: float) -> None:
    keep, state = _ours(shape, p, seed=7, dtype=torch.float32)
    want_keep, want_state = _eager_keep(shape, p, seed=7, dtype=torch.float32)
    assert torch.equal(keep, want_keep)
    assert torch.equal(state, want_state)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_probabilities_dtype_does_not_change_the_bits(dtype: torch.dtype) -> None:
    keep, state = _ours((4, 33, 45), 0.2, seed=3, dtype=dtype)
    want_keep, want_state = _eager_keep((4, 33, 45), 0.2, seed=3, dtype=dtype)
    assert torch.equal(keep, want_keep) and torch.equal(state, want_state)


def test_traced_native_dropout_draws_the_same_mask() -> None:
    """A traced graph runs aten.native_dropout rather than _dropout_impl; same bits either way."""
    keep, state = _ours((6, 40, 37), 0.3, seed=11, dtype=torch.float32)
    torch.manual_seed(11)
    _, mask = torch.ops.aten.native_dropout(torch.ones(6, 40, 37), 0.3, True)
    assert torch.equal(keep, mask) and torch.equal(state, torch.get_rng_state())


def test_whole_draw_fallback_is_exact_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """The path taken where the per-process self-check finds chunked draws differ."""
    monkeypatch.setattr(dropout_mask_module, "_cpu_mode", lambda dtype: "whole")
    for shape in [(3, 9, 21), (3000, 700)]:
        keep, state = _ours(shape, 0.4, seed=5, dtype=torch.bfloat16)
        want_keep, want_state = _eager_keep(shape, 0.4, seed=5, dtype=torch.bfloat16)
        assert torch.equal(keep, want_keep) and torch.equal(state, want_state)


def test_self_check_leaves_the_global_generator_alone() -> None:
    dropout_mask_module._cpu_mode.cache_clear()
    torch.manual_seed(0)
    before = torch.get_rng_state()
    assert dropout_mask_module._cpu_mode(torch.float32) in ("chunks", "whole")
    assert torch.equal(before, torch.get_rng_state())


def test_zero_probability_keeps_everything_and_draws_nothing() -> None:
    torch.manual_seed(2)
    before = torch.get_rng_state()
    packed = attention_dropout_mask((3, 4, 13), 0.0)
    assert torch.equal(torch.get_rng_state(), before)
    assert unpack_bits(packed, 13).all()
    # padding bits stay zero, as pack_bits leaves them
    assert torch.equal(unpack_bits(packed, 16)[..., 13:], torch.zeros(3, 4, 3, dtype=torch.bool))


def test_chunked_draw_needs_far_less_than_a_bool_mask() -> None:
    shape = (16, 1024, 1024)
    if dropout_mask_module._cpu_mode(torch.float32) != "chunks":
        pytest.skip("this machine's bernoulli_ does not draw serially; masks are drawn whole")
    m = memfit.measure(lambda: attention_dropout_mask(shape, 0.1))
    assert m.peak_bytes is not None
    elements = 16 * 1024 * 1024
    assert m.peak_bytes < elements / 3  # a whole bool mask would take `elements` bytes


def test_op_is_tagged_nondeterministic_seeded() -> None:
    op = torch.ops.memfit.attention_dropout_mask.default
    assert torch.Tag.nondeterministic_seeded in op.tags


@pytest.mark.parametrize(
    ("shape", "p", "match"),
    [((3, 4), 1.0, "1.0"), ((3, 4), -0.1, "-0.1"), ((), 0.1, r"\(\)"), ((3, -1), 0.1, "-1")],
)
def test_bad_arguments_raise_value_errors(shape: tuple[int, ...], p: float, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        attention_dropout_mask(shape, p)
