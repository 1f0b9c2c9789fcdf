"""Which ranks share a node, and whether a collective's group stays inside one.

[Note: nodes from the launch] Every launcher we support (``slipstream run``, torchrun, the
DeepSpeed launcher, SLURM through torchrun) starts the same number of ranks on every node, ranks
``k·L … k·L + L − 1`` on node ``k``, and says ``L`` in ``LOCAL_WORLD_SIZE``. That is all a rank
needs to know which of its peers are across a slow link. Setting ``LOCAL_WORLD_SIZE`` below the
real count simulates several nodes on one machine (the tests run 2 × 2 on four local ranks); the
collectives are the same, only the byte accounting (``comms_log.bytes_by_link``) and the layouts
that ask for intra-node groups (hpZ, MiCS) read it.
"""

from __future__ import annotations

import os

import torch.distributed as dist

INTRA, INTER = "intra-node", "inter-node"


def ranks_per_node() -> int:
    """``LOCAL_WORLD_SIZE`` (the whole world when unset or not a divisor of it: one node)."""
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    except ValueError:
        return world
    return local if 0 < local and world % local == 0 else world


def node_of(rank: int) -> int:
    """The node a global rank runs on ([Note: nodes from the launch])."""
    return rank // ranks_per_node()


def link_class(ranks: tuple[int, ...] | None) -> str:
    """``INTRA`` when every rank of the group (None: the world) is on one node, else ``INTER``."""
    if ranks is None:
        ranks = tuple(range(dist.get_world_size()))
    return INTRA if len({node_of(r) for r in ranks}) <= 1 else INTER
