"""memfit.largest_batch: the search is exact against brute force, and a found batch was measured to
fit while the next one up was measured not to."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit.execution.largest_batch import bisect_largest


@pytest.mark.parametrize("multiple_of", [1, 3, 8])
@pytest.mark.parametrize("start", [1, 5, 64, 1000])
def test_bisect_finds_the_largest_fitting_multiple_as_brute_force_does(
    start: int, multiple_of: int
) -> None:
    limit = 200
    for threshold in [0, 1, 2, 7, 8, 9, 63, 64, 100, 199, 200, 500]:
        asked: list[int] = []

        def fits(n: int, threshold: int = threshold, asked: list[int] = asked) -> bool:
            assert n % multiple_of == 0 and 0 < n <= limit, n
            assert n not in asked, f"size {n} asked twice"
            asked.append(n)
            return n <= threshold

        found, first_not, capped = bisect_largest(
            fits, start=start, multiple_of=multiple_of, limit=limit
        )
        multiples = range(multiple_of, limit + 1, multiple_of)
        brute = max((n for n in multiples if n <= threshold), default=0)
        assert found == brute
        if capped:
            assert found == max(multiples) and first_not is None
        else:
            assert first_not == found + multiple_of
            assert first_not in asked and (found == 0 or found in asked)


def test_bisect_refuses_a_multiple_above_the_limit() -> None:
    with pytest.raises(ValueError, match="multiple_of"):
        bisect_largest(lambda n: True, start=1, multiple_of=10, limit=5)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(8)])


def _make(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, 16, generator=g), torch.randn(n, 16, generator=g)


def test_arguments_are_checked_before_any_step_runs() -> None:
    model = _mlp()
    with pytest.raises(ValueError, match="fraction"):
        memfit.largest_batch(model, _make, 0.5, loss=F.mse_loss)
    with pytest.raises(ValueError, match="parameters and buffers take"):
        memfit.largest_batch(model, _make, 1000, loss=F.mse_loss)
    with pytest.raises(TypeError, match="not both"):
        memfit.largest_batch(model, _make, "1MiB", loss=F.mse_loss, step_fn=lambda x, y: x.sum())


@pytest.mark.slow
def test_the_found_batch_fits_and_the_next_one_up_was_measured_not_to() -> None:
    model = _mlp()
    x, y = _make(32)
    plain = memfit.measure(lambda: F.mse_loss(model(x), y).backward())
    model.zero_grad(set_to_none=True)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = weights + x.nbytes + y.nbytes + int(plain.peak_bytes or 0)

    found = memfit.largest_batch(
        model, _make, budget, loss=F.mse_loss, policy="memory", start=32, multiple_of=8
    )
    by_batch = {p.batch: p for p in found.probes}
    assert found.batch >= 32  # "memory" keeps less than plain autograd at plain's batch
    assert found.total_bytes is not None and found.total_bytes <= budget
    assert by_batch[found.batch].fits
    nxt = by_batch[found.first_not_fitting]
    assert found.first_not_fitting == found.batch + 8 and not nxt.fits
    assert nxt.total_bytes is None or nxt.total_bytes > budget
    assert found.plan is not None and found.seconds_per_sample and found.seconds_per_sample > 0
    assert all(p.grad is None for p in model.parameters())  # left as zero_grad leaves it
