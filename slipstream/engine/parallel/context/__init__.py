"""Context parallelism: ring attention over contiguous or zig-zag sequence shards."""

from slipstream.engine.parallel.context.layout import Layout, pair_work
from slipstream.engine.parallel.context.ring import ATTENTION_NAME, RingAttention

__all__ = ["ATTENTION_NAME", "Layout", "RingAttention", "pair_work"]
