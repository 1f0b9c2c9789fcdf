"""DeepSpeed checkpoints in: find, read without unpickling code, convert to slipstream's format.

Modules: ``unpickle`` (the allow-listed ``torch.load``), ``source`` (finding a checkpoint and what
describes it), ``partitions`` (which elements of which parameter each DeepSpeed rank holds),
``convert`` (writing a slipstream checkpoint from it, one rank at a time), ``staging`` (loading
one into a running job). ``engine.load_checkpoint`` and ``slipstream checkpoint inspect|convert``
use them; see docs/checkpoints.md.
"""
