"""Parameter groups sharded over different process groups: which goes where, and the two reductions
that must count every parameter once (the gradient norm here; used-parameter flags in used_flags.py).

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
from slipstream.utils.placement import placement_of


@dataclasses.dataclass
class GroupShare:
    """The parameter groups sharded over one process group (``group``; None: the world)."""

    group: dist.ProcessGroup | None
    specs: list[ParamGroupSpec]


def split_by_group(
    specs: list[ParamGroupSpec], default: dist.ProcessGroup | None, with_default: bool = False
) -> list[GroupShare]:
    """One share per distinct sharding group, in first-use order. ``with_default``: the default group's
    share exists even without a parameter group (stage 3 puts parameters of no group there)."""
    shares: dict[int, GroupShare] = {}
    for spec in specs:
        group = spec.sharding_group(default)
        shares.setdefault(id(group), GroupShare(group, [])).specs.append(spec)
    if with_default or not shares:
        shares.setdefault(id(default), GroupShare(default, []))
    return list(shares.values())


def sum_over_groups(partials: list[tuple[dist.ProcessGroup | None, torch.Tensor]]) -> torch.Tensor:
    """Sum each partial (e.g. a squared norm, shape (1,)) over its group, then add them up."""
    total: Any = None
    for group, partial in partials:
        comm.all_reduce(partial, group=group, tag="gradient norm", inline=True).wait()
        total = partial if total is None else total + partial
    return total


def first_of(group: dist.ProcessGroup | None) -> bool:
    """Whether this rank is the first of ``group`` (None: the world): the one that saves what the group replicates."""
    return dist.get_rank() == (0 if group is None else dist.get_process_group_ranks(group)[0])


def model_spread(params: list[torch.Tensor], default: dist.ProcessGroup | None) -> bool:
    """Whether ranks outside the default group hold other parts of the model (tp/pp/ep pieces).

    [Note: the norm of a spread model] Without tensor, pipeline or expert parallelism every rank
    of the default group holds (a shard of) the same parameters, and one sum per sharding group
    counts each element once. When the model is spread (the default group does not span the world,
    or some parameter is a placed piece), each rank adds the elements it would *save* (never a
    duplicate, never another subgroup's replica) and one sum over the world counts each element of
    the whole model exactly once, whatever the mesh. The answer is the same on every rank of the
    world, so it is decided from facts every rank shares (the mesh and the kind of model).
    """
    if default is not None and dist.get_world_size(default) != dist.get_world_size():
        return True
    return any(placement_of(p) is not None for p in params)


def is_replica(group: dist.ProcessGroup | None, default: dist.ProcessGroup | None) -> bool:
    """Whether this rank's partition over ``group`` is a replica that another subgroup's ranks save.

    [Note: replicas across subgroups] Every rank of the default group holds the same parameters, so
    a parameter group sharded over subgroups of it ({0,1} and {2,3} of four ranks) exists once per
    subgroup. A checkpoint must hold each element once: the subgroup with the default group's first
    rank saves, the others mark their slices ``duplicate`` (never saved by them; loaded by every
    rank). Placed pieces (utils/placement.py) skip this rule: experts in different subgroups are
    different parameters, not replicas, and their placement says which copy is a duplicate.
    """
    if group is default:
        return False
    first = 0 if default is None else dist.get_process_group_ranks(default)[0]
    members = range(dist.get_world_size()) if group is None else dist.get_process_group_ranks(group)
    return first not in members
