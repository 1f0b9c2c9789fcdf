"""Monitoring: progress line, TensorBoard/CSV/W&B writers, wall-clock timers, FLOPs and MFU."""

from slipstream.engine.monitor.monitor import TrainingMonitor

__all__ = ["TrainingMonitor"]
