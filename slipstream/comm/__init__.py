"""Process groups and collectives with async handles, plus the per-step comms log."""

from slipstream.comm.collectives import (
    CollectiveError,
    ReduceOp,
    Work,
    all_gather_into_tensor,
    all_gather_objects,
    all_reduce,
    all_to_all_single,
    all_to_all_v,
    barrier,
    broadcast,
    broadcast_object,
    gather_objects,
    reduce_scatter_tensor,
    shift_ring,
)
from slipstream.comm.comms_log import CommRecord, CommsLog
from slipstream.comm.distributed import LaunchEnvError, get_rank, get_world_size, init_distributed
from slipstream.comm.lanes import lane_group
from slipstream.comm.process import PROCESS
from slipstream.comm.ring_collectives import ring_context

comms_log = PROCESS.log  # the public name of this process's comms log (comm/process.py owns it)

__all__ = [
    "CollectiveError",
    "CommRecord",
    "CommsLog",
    "ReduceOp",
    "Work",
    "all_gather_into_tensor",
    "all_gather_objects",
    "all_reduce",
    "broadcast_object",
    "gather_objects",
    "all_to_all_single",
    "all_to_all_v",
    "barrier",
    "broadcast",
    "comms_log",
    "reduce_scatter_tensor",
    "ring_context",
    "shift_ring",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "LaunchEnvError",
    "lane_group",
]
