"""Expert parallelism: dropless all-to-all dispatch to the rank that owns each expert."""

from slipstream.engine.parallel.expert.dispatch import ExpertParallelExperts
from slipstream.engine.parallel.expert.options import ExpertOptions
from slipstream.engine.parallel.expert.parallelize import ExpertPlan, parallelize_experts

__all__ = ["ExpertOptions", "ExpertParallelExperts", "ExpertPlan", "parallelize_experts"]
