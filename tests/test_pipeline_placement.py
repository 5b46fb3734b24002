"""``memfit.pipeline.placement``: which rank holds which stage, as torch places them."""

from __future__ import annotations

import itertools

from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

from memfit.pipeline.placement import local_stages, stage_ranks


def test_looped_schedules_deal_stages_out_in_turn_and_v_schedules_fold_them() -> None:
    assert stage_ranks("gpipe", 4, 1) == (0, 1, 2, 3)
    assert stage_ranks("interleaved_1f1b", 2, 2) == (0, 1, 0, 1)
    assert stage_ranks("looped_bfs", 3, 2) == (0, 1, 2, 0, 1, 2)
    assert stage_ranks("zbv_zero_bubble", 2, 2) == (0, 1, 1, 0)
    assert stage_ranks("dualpipev", 4, 2) == (0, 1, 2, 3, 3, 2, 1, 0)
    assert local_stages("dualpipev", 4, 2, 0) == [0, 7]
    assert local_stages("interleaved_zero_bubble", 4, 2, 1) == [1, 5]


def test_placements_are_torchs() -> None:
    for ranks, per_rank in itertools.product(range(1, 6), range(1, 5)):
        total = ranks * per_rank
        looped = generate_stage_to_rank_mapping(ranks, total, style="loop")
        assert stage_ranks("looped_bfs", ranks, per_rank) == tuple(looped[s] for s in range(total))
        v = generate_stage_to_rank_mapping(ranks, total, style="v")
        assert stage_ranks("dualpipev", ranks, per_rank) == tuple(v[s] for s in range(total))
