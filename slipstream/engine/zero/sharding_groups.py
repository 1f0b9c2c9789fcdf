"""Parameter groups sharded over different process groups: which goes where, and the two reductions
that must count every parameter once (used-parameter flags and the gradient norm).

[Note: collectives per group] Each distinct sharding group gets its own partition, in the order in
which the user's parameter groups first name it (the same position on every rank, although the
group objects differ between ranks of different subgroups). A rank issues one reduction per
partition, over that partition's group: a parameter's partial norm is summed only over the ranks
that share it, never twice across replicas. With one group this is the single collective of a
plain data-parallel run.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from slipstream import comm
from slipstream.engine.zero.strategy import ParamGroupSpec


@dataclasses.dataclass
class GroupShare:
    """The parameter groups sharded over one process group (``group``; None: the world)."""

    group: dist.ProcessGroup | None
    specs: list[ParamGroupSpec]


def split_by_group(specs: list[ParamGroupSpec], default: dist.ProcessGroup | None, with_default: bool = False) -> list[GroupShare]:
    """One share per distinct sharding group, in first-use order. ``with_default``: the default group's
    share exists even without a parameter group (stage 3 puts parameters of no group there)."""
    shares: dict[int, GroupShare] = {}
    for spec in specs:
        group = spec.sharding_group(default)
        shares.setdefault(id(group), GroupShare(group, [])).specs.append(spec)
    if with_default or not shares:
        shares.setdefault(id(default), GroupShare(default, []))
    return list(shares.values())


def reduce_flags(used: torch.Tensor, members: list[tuple[dist.ProcessGroup | None, list[int]]]) -> None:
    """``used[i]`` = 1 where parameter ``i`` got a gradient on any rank of its group (MAX, in place)."""
    if len(members) == 1:
        comm.all_reduce(used, op=dist.ReduceOp.MAX, group=members[0][0], tag="used-parameter flags").wait()
        return
    for group, indices in members:
        if not indices:  # the same on every rank of the group: its ranks share their parameter groups
            continue
        mine = torch.tensor(indices, dtype=torch.long, device=used.device)
        flags = used.index_select(0, mine)
        comm.all_reduce(flags, op=dist.ReduceOp.MAX, group=group, tag="used-parameter flags").wait()
        used.index_copy_(0, mine, flags)


def sum_over_groups(partials: list[tuple[dist.ProcessGroup | None, torch.Tensor]]) -> torch.Tensor:
    """Sum each partial (e.g. a squared norm, shape (1,)) over its group, then add them up."""
    total: Any = None
    for group, partial in partials:
        comm.all_reduce(partial, group=group, tag="gradient norm").wait()
        total = partial if total is None else total + partial
    return total
