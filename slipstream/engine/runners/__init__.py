"""Step runners: how the Engine's forward, backward and evaluation run in each mode (see base.py)."""

from slipstream.engine.runners.base import StepRunner, Windows, draw, mean_over_dp
from slipstream.engine.runners.direct import DirectRunner
from slipstream.engine.runners.pipeline import DeferredLoss, PipelineRunner

__all__ = ["DeferredLoss", "DirectRunner", "PipelineRunner", "StepRunner", "Windows", "draw", "mean_over_dp"]
