"""DeepSpeed-Ulysses sequence parallelism for unchanged models: the engine shards the batch on the
sequence, attention is computed on whole sequences for a share of the heads."""

from slipstream.engine.parallel.sequence.inputs import SequenceSharder
from slipstream.engine.parallel.sequence.ulysses import UlyssesAttention, all_to_all, parallelize_sequence

__all__ = ["SequenceSharder", "UlyssesAttention", "all_to_all", "parallelize_sequence"]
