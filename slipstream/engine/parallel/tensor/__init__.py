"""Tensor parallelism (Megatron-style, with sequence parallelism) for unchanged models.

``parallelize_tensor(model, mesh, options)`` is the one entry ``parallelize`` calls; the
pieces: ``ops`` (the f/g autograd pairs), ``layers`` (sharded leaves, vocabulary layers),
``plan`` (config → Hugging Face ``tp_plan`` → inferred), ``probe`` (the recorded run the plan and the
block twin read; the twin itself is ``parallel/twin/tensor_blocks.py``), ``sequence``.
"""

from slipstream.engine.parallel.tensor.options import TensorOptions
from slipstream.engine.parallel.tensor.parallelize import TensorParallel, parallelize_tensor
from slipstream.engine.parallel.tensor.plan import PlanEntry, validate_partition_config

__all__ = ["PlanEntry", "TensorOptions", "TensorParallel", "parallelize_tensor", "validate_partition_config"]
