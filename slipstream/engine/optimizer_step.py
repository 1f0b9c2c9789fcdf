"""The update at an accumulation boundary: unscale, the overflow check, clipping, the strategy's step, the schedule.

[Note: one norm, two uses] The strategy's global gradient norm (over every shard, every axis) is
read once: it is the fp16/bf16 overflow check (non-finite: the step is skipped, the loss scale
backs off) and the clipping coefficient, folded with the loss-scale inverse into one scaling of
the gradients before the strategy steps.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from slipstream.engine.precision import LossScaler
from slipstream.engine.zero.strategy import ShardingStrategy
from slipstream.utils.logging import get_logger

logger = get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class StepResult:
    grad_norm: float  # unscaled, before clipping
    applied: bool  # False: a non-finite norm skipped the step


@dataclasses.dataclass(frozen=True)
class OptimizerStep:
    strategy: ShardingStrategy
    loss_scaler: LossScaler
    clip: float  # gradient_clipping (0: off)
    check_overflow: bool  # fp16 always, bf16 unless bf16.check_grad_overflow is off (as DeepSpeed)
    before_update: Callable[[], None]  # e.g. wait for an async checkpoint still reading the weights

    def __call__(self, lr_scheduler: Any, step: int) -> StepResult:
        inv_scale = 1.0 / self.loss_scaler.scale
        norm = float(self.strategy.global_grad_norm()) * inv_scale
        overflow = not math.isfinite(norm) and self.check_overflow
        if overflow:
            if not self.loss_scaler.dynamic:
                logger.warning("step %d: non-finite gradient norm (%s); step skipped", step, norm)
        else:
            coef = inv_scale * (min(1.0, self.clip / (norm + 1e-6)) if self.clip > 0 else 1.0)
            self.strategy.scale_gradients(coef)
            self.before_update()
            self.strategy.step()
            if lr_scheduler is not None:
                lr_scheduler.step()
        self.loss_scaler.update(overflow)
        self.strategy.zero_grad()
        return StepResult(norm, not overflow)
