"""The step record the engine hands the monitor at each optimizer step (the monitor never sees the engine)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What one optimizer step reports: counters and the numbers the progress line and writers show."""

    global_steps: int
    global_samples: int
    train_batch_size: int
    lr: float | None  # the first parameter group's; None without groups
    grad_norm: float | torch.Tensor | None  # a device scalar: read only where it is shown
    loss_scale: float
    dynamic_loss_scale: bool
    # per MoE layer, the choices this rank's tokens made of each expert over the step (expert parallel)
    expert_tokens: tuple[tuple[int, ...], ...] = ()
    # the compiled blocks' counts so far (graphs, graph_breaks, recompiles, seconds); None: nothing compiled
    compile: Mapping[str, float] | None = None
