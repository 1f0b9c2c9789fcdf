"""Lanes (comm/lanes.py): a subgroup's twin is made by its members only, and must be made even when they hold
different numbers of process groups ([Note: the same name on every member]); before, they waited for ever."""

from __future__ import annotations

import torch
import torch.distributed as dist

from slipstream.comm import lane_group
from tests.harness import run_distributed


def _twins_after_uneven_groups() -> list[float]:
    rank = dist.get_rank()
    if rank == 2:  # a group only this rank made (as a pipeline stage may): now rank 2 holds one more than rank 0
        dist.new_group([rank], use_local_synchronization=True)
    pair = dist.new_group([0, 2]), dist.new_group([1, 3])
    mine = pair[rank % 2]
    sums = []
    for lane in ("first lane", "second lane"):
        twin = lane_group(mine, lane)
        assert twin is not mine and dist.get_process_group_ranks(twin) == dist.get_process_group_ranks(mine)
        x = torch.tensor([float(rank)])
        dist.all_reduce(x, group=twin)
        sums.append(float(x))
    return sums


def test_lanes_are_made_when_members_hold_different_group_counts() -> None:
    results = run_distributed(4, _twins_after_uneven_groups, timeout=120)
    assert results == [[2.0, 2.0], [4.0, 4.0], [2.0, 2.0], [4.0, 4.0]]
