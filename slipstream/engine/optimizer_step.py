"""The update at an accumulation boundary: unscale, the overflow check, clipping, the strategy's step, the schedule.

[Note: one norm, two uses] The strategy's global gradient norm (over every shard, every axis) is
read once: it is the fp16/bf16 overflow check (non-finite: the step is skipped, the loss scale
backs off) and the clipping coefficient, folded with the loss-scale inverse into one scaling of
the gradients before the strategy steps.

[Note: the step does not wait for the device] Reading the norm on the host (``float(norm)``)
waits for everything queued on the device: the backward, the reductions, the norm itself. The
host then launches the optimizer and the next forward into an idle GPU, which is the host overhead
a GPU step shows and DDP's does not (torch's ``clip_grad_norm_`` never reads the norm). Only the
overflow check needs the value on the host: it decides whether the step runs at all (fp16 always,
bf16 unless ``bf16.check_grad_overflow`` is off). Without it the clipping coefficient is computed
on the device, as torch's ``clip_grad_norm_`` computes it, and the norm stays a device tensor that
is read only where someone asks for it (``get_global_grad_norm``, the progress line, the writers).
On a CPU nothing runs ahead of the host, so there the norm is read as before: the read waits for
nothing, and a coefficient of one skips a pass over the gradients that the device path makes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from slipstream.engine.precision import LossScaler
from slipstream.engine.zero.strategy import ShardingStrategy
from slipstream.utils.logging import get_logger

logger = get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class StepResult:
    grad_norm: float | torch.Tensor  # unscaled, before clipping; a device scalar where the host never read it
    applied: bool  # False: a non-finite norm skipped the step


@dataclasses.dataclass(frozen=True)
class OptimizerStep:
    strategy: ShardingStrategy
    loss_scaler: LossScaler
    clip: float  # gradient_clipping (0: off)
    check_overflow: bool  # fp16 always, bf16 unless bf16.check_grad_overflow is off (as DeepSpeed)
    before_update: Callable[[], None]  # e.g. wait for an async checkpoint still reading the weights
    device_runs_ahead: bool  # the accelerator's runs_ahead_of_host: reading the norm would wait for it

    def __call__(self, lr_scheduler: Any, step: int) -> StepResult:
        inv_scale = 1.0 / self.loss_scaler.scale
        norm: float | torch.Tensor = self.strategy.global_grad_norm()
        coef: float | torch.Tensor
        # whether the step runs at all is the host's decision: it reads the norm (as it may where that waits for nothing)
        if self.check_overflow or not self.device_runs_ahead:
            norm = float(norm) * inv_scale
            overflow = self.check_overflow and not math.isfinite(norm)
            coef = inv_scale * (min(1.0, self.clip / (norm + 1e-6)) if self.clip > 0 else 1.0)
        else:  # [Note: the step does not wait for the device]
            norm, overflow = norm * inv_scale if inv_scale != 1.0 else norm, False
            coef = inv_scale
            if self.clip > 0:
                coef = (self.clip / (norm + 1e-6)).clamp(max=1.0)
                coef = coef * inv_scale if inv_scale != 1.0 else coef
        if overflow:
            if not self.loss_scaler.dynamic:
                logger.warning("step %d: non-finite gradient norm (%s); step skipped", step, norm)
        else:
            self.strategy.scale_gradients(coef)
            self.before_update()
            self.strategy.step()
            if lr_scheduler is not None:
                lr_scheduler.step()
        self.loss_scaler.update(overflow)
        self.strategy.zero_grad()
        return StepResult(norm, not overflow)
