"""Context parallelism: ring attention over contiguous or zig-zag sequence shards."""

from slipstream.engine.parallel.context.allgather import AllGatherKVAttention
from slipstream.engine.parallel.context.ring_attention import RingAttention
from slipstream.engine.parallel.context.token_layout import Layout, pair_work

__all__ = ["AllGatherKVAttention", "Layout", "RingAttention", "pair_work"]
