"""``memfit.pipeline.streams``: each of a rank's stages draws from its own stream."""

from __future__ import annotations

import torch
import torch.nn as nn

from memfit.pipeline.streams import OwnStream


def test_interleaved_stages_draw_what_each_would_alone_and_leave_the_rank_generator() -> None:
    cpu = torch.device("cpu")
    x = torch.ones(4, 16)
    alone = []
    for _ in range(2):  # each stage alone, seeded as its rank is
        torch.manual_seed(7)
        alone.append([nn.Dropout(0.5)(x) for _ in range(3)])
    torch.manual_seed(7)
    stages = [OwnStream(nn.Dropout(0.5), cpu) for _ in range(2)]
    for stage in stages:
        stage.start()
    before = torch.get_rng_state()
    got: list[list[torch.Tensor]] = [[], []]
    for i in range(3):  # the schedule's order: the stages' micro-batches interleaved
        for s in (1, 0) if i % 2 else (0, 1):
            got[s].append(stages[s](x))
    assert torch.equal(torch.get_rng_state(), before)
    for s in range(2):
        for a, b in zip(got[s], alone[s]):
            assert torch.equal(a, b)
    assert not torch.equal(got[0][0], got[0][1])  # the stream moves on per micro-batch


def test_a_stream_not_started_draws_from_the_rank_generator() -> None:
    torch.manual_seed(3)
    expected = nn.Dropout(0.5)(torch.ones(8))
    torch.manual_seed(3)
    assert torch.equal(OwnStream(nn.Dropout(0.5), torch.device("cpu"))(torch.ones(8)), expected)
