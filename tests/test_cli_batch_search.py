"""The largest-batch search: its bisection on a known threshold, and on real measured steps.

The measured test is the property the command promises: the batch the search returns fits the
budget, and that batch plus one step does not, each measured again independently of the search.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memfit.cli.batch_search import (
    Probe,
    batch_size_of,
    measure_probe,
    search_max_batch,
)
from memfit.cli.errors import CliError
from memfit.cli.steps import Workload
from memfit.planning.policy import Policy


def threshold_probe(limit: int, calls: list[int]):
    def probe(batch: int) -> Probe:
        calls.append(batch)
        return Probe(batch, fits=batch <= limit, total_bytes=100 * batch, peak_bytes=None)

    return probe


@pytest.mark.parametrize(
    "limit, start, step",
    [
        (1000, 16, 1),
        (1000, 4096, 1),
        (17, 16, 1),
        (16, 16, 1),
        (1, 16, 1),
        (300, 7, 8),
        (64, 64, 64),
        (65, 8, 8),
    ],
)
def test_search_finds_the_threshold_and_measures_one_step_above(limit, start, step) -> None:
    calls: list[int] = []
    r = search_max_batch(
        threshold_probe(limit, calls),
        label="x",
        budget_bytes=0,
        start=start,
        step=step,
        limit=1 << 20,
    )
    assert r.max_batch == limit // step * step
    assert r.first_not_fitting == r.max_batch + step
    assert r.max_batch + step in calls and (r.max_batch == 0 or r.max_batch in calls)
    assert len(calls) == len(set(calls)) == len(r.probes)  # nothing measured twice
    assert len(calls) <= 2 * (limit // step + 1).bit_length() + 4
    assert not r.capped


def test_search_stops_at_the_limit_and_when_nothing_fits() -> None:
    r = search_max_batch(threshold_probe(10**9, []), label="x", budget_bytes=0, start=3, limit=100)
    assert r.capped and r.max_batch == 100 and r.first_not_fitting is None
    r = search_max_batch(threshold_probe(0, []), label="x", budget_bytes=0, start=8)
    assert r.max_batch == 0 and r.first_not_fitting == 1 and r.total_bytes is None


def test_the_batch_size_is_read_along_batch_dim_and_a_missing_dim_named_as_the_flag() -> None:
    x = torch.arange(6.0).reshape(3, 2)
    assert batch_size_of(((torch.ones(2, 9),), {}), {}, 1) == 9
    with pytest.raises(CliError, match="--batch-dim 3"):
        batch_size_of((x,), {}, 3)


def test_measured_max_batch_fits_and_one_more_step_does_not() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 10)
    )
    work = Workload(model, (torch.randn(16, 32),))
    policy, device, budget, step = Policy("memory"), torch.device("cpu"), 2**20, 16

    def probe(batch: int) -> Probe:
        return measure_probe(work, policy, device, budget, 0, batch)

    result = search_max_batch(probe, label="memory", budget_bytes=budget, start=16, step=step)
    assert result.max_batch > 16 and not result.capped
    again, above = probe(result.max_batch), probe(result.max_batch + step)
    assert again.fits and again.total_bytes <= budget, again
    assert not above.fits and above.total_bytes > budget, above
    assert again.total_bytes == result.total_bytes  # CPU accounting is exact and deterministic
