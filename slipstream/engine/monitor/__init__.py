"""Monitoring: progress line, TensorBoard/CSV/W&B writers, wall-clock timers, FLOPs and MFU."""

from slipstream.engine.monitor.monitor import TrainingMonitor
from slipstream.engine.monitor.record import StepRecord

__all__ = ["StepRecord", "TrainingMonitor"]
