"""Twin process groups ("lanes") so independent streams of collectives never wait on each other.

[Note: why lanes] Backends match collectives by issue order within a group. ZeRO-3 issues
all-gathers (forward and backward) and reduce-scatters (backward) from different hooks; if both
shared one group, every rank would have to interleave them identically, which data-dependent
control flow cannot promise. On their own lanes each kind only needs its own order to match,
and on gloo each lane gets its own ring thread, so gathers overlap reductions.

[Note: twins of a subgroup] A twin of a group smaller than the world is made by its members only
(``use_local_synchronization``): ranks of different subgroups (ZeRO over {0,1} on ranks 0 and 1,
over {2,3} on ranks 2 and 3) each ask for their own group's twin, so a world-wide creation would
never line up. Members agree on the twin because they make the same groups in the same order.

[Note: the same name on every member] torch names a locally synchronised group by hashing its
ranks with the number of process groups the *calling* rank holds, and its members rendezvous under
that name. A rank can hold more groups than its peers (a pipeline stage that made a group the other
stage did not need), and then the members hash different names and wait for each other forever
(seen: a tensor × pipeline engine, then a Ulysses × ring one in the same processes). So before
making a twin the members compare their counts, and each one below the highest first makes
single-rank groups of its own until they match.
"""

from __future__ import annotations

import torch.distributed as dist

from slipstream.comm.distributed import current_timeout
from slipstream.comm.process import PROCESS


def lane_group(group: dist.ProcessGroup | None, lane: str) -> dist.ProcessGroup | None:
    """A process group with the same ranks and backend as ``group``, one per ``lane`` name.

    Collective (every rank must ask for the same lanes in the same order); cached afterwards.
    A world of one needs no twin and gets ``group`` back.
    """
    if dist.get_world_size(group) == 1:
        return group
    parent = group if group is not None else dist.group.WORLD
    key = (id(parent), lane)
    with PROCESS.lanes_lock:
        cached = PROCESS.lanes.get(key)
        if cached is not None and cached[0] is parent:
            return cached[1]
        twin = twin_group(group, str(dist.get_backend(group)))
        PROCESS.lanes[key] = (parent, twin)
        return twin


def twin_group(group: dist.ProcessGroup | None, backend: str) -> dist.ProcessGroup:
    """A new process group of ``group``'s ranks on ``backend``, made by its members only when it is smaller than the
    world ([Note: twins of a subgroup], [Note: the same name on every member]). Collective over ``group``."""
    ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    local = len(ranks) < dist.get_world_size()
    if local:
        _match_group_counts(group)
    return dist.new_group(ranks=ranks, backend=backend, timeout=current_timeout(), use_local_synchronization=local)


def _match_group_counts(group: dist.ProcessGroup | None) -> None:
    """Pad this rank's process-group count to the highest among ``group``'s members ([Note: the same name on every
    member]). Collective over ``group``."""
    held = len(dist.distributed_c10d._world.pg_names)
    counts: list[int | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(
        counts, held, group=group
    )  # torch's own: slipstream's collectives may make groups themselves
    highest = max(c for c in counts if c is not None)
    for _ in range(highest - held):
        dist.new_group([dist.get_rank()], timeout=current_timeout(), use_local_synchronization=True)
