"""DeepSpeed-Ulysses sequence parallelism for unchanged models: the engine shards the batch on the
sequence, attention is computed on whole sequences for a share of the heads."""

from slipstream.engine.parallel.sequence.blockwise import BlockwiseSharder
from slipstream.engine.parallel.sequence.inputs import SequenceSharder
from slipstream.engine.parallel.sequence.options import SequenceOptions
from slipstream.engine.parallel.sequence.parallelize import parallelize_attention
from slipstream.engine.parallel.sequence.ulysses import ATTENTION_NAME, UlyssesAttention, all_to_all

# what the step runners hold: the kernels' sharder (the batch cut on the sequence) or the blockwise one
Sharder = SequenceSharder | BlockwiseSharder

__all__ = [
    "ATTENTION_NAME",
    "BlockwiseSharder",
    "SequenceOptions",
    "SequenceSharder",
    "Sharder",
    "UlyssesAttention",
    "all_to_all",
    "parallelize_attention",
]
