"""Pipeline parallelism for unchanged models: cut, schedules as action lists, simulator, executor."""

from slipstream.engine.parallel.pipeline.actions import Action, Op, StageLayout, with_communication
from slipstream.engine.parallel.pipeline.options import PipelineOptions
from slipstream.engine.parallel.pipeline.parallelize import Pipeline, StepReport, parallelize_pipeline
from slipstream.engine.parallel.pipeline.schedules import NAMES, Schedule, build
from slipstream.engine.parallel.pipeline.simulate import Costs, peak_in_flight, predicted_bubble, simulate

__all__ = [
    "NAMES",
    "Action",
    "Costs",
    "Op",
    "Pipeline",
    "PipelineOptions",
    "Schedule",
    "StageLayout",
    "StepReport",
    "build",
    "parallelize_pipeline",
    "peak_in_flight",
    "predicted_bubble",
    "simulate",
    "with_communication",
]
