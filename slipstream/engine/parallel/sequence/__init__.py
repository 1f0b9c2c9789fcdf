"""DeepSpeed-Ulysses sequence parallelism for unchanged models: the engine shards the batch on the
sequence, attention is computed on whole sequences for a share of the heads."""

from slipstream.engine.parallel.sequence.inputs import SequenceSharder
from slipstream.engine.parallel.sequence.options import SequenceOptions
from slipstream.engine.parallel.sequence.parallelize import parallelize_attention
from slipstream.engine.parallel.sequence.ulysses import ATTENTION_NAME, UlyssesAttention, all_to_all

__all__ = ["ATTENTION_NAME", "SequenceOptions", "SequenceSharder", "UlyssesAttention", "all_to_all", "parallelize_attention"]
