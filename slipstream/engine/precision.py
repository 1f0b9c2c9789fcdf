"""Loss scaling for fp16 (and the no-op scalers for fp32/bf16).

fp32 master weights live with the sharding strategy, because in ZeRO they are partitioned; this
module decides how the loss is scaled and what happens after an overflow. Overflow is read from
the global gradient norm, which every rank computes identically, so all ranks skip together.
"""

from __future__ import annotations

import dataclasses

import torch

from slipstream.engine.config import FP16Config
from slipstream.utils.logging import get_logger

logger = get_logger(__name__)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class LossScaler:
    """No scaling (fp32, bf16): the scale is 1 and a step is never skipped."""

    dynamic = False

    @property
    def scale(self) -> float:
        return 1.0

    def update(self, overflow: bool) -> None:
        return None

    def state_dict(self) -> dict[str, float | int]:
        return {}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        return None


class StaticLossScaler(LossScaler):
    def __init__(self, scale: float) -> None:
        self._scale = scale

    @property
    def scale(self) -> float:
        return self._scale

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self._scale}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self._scale = float(state["scale"])


@dataclasses.dataclass
class DynamicLossScaler(LossScaler):
    """DeepSpeed's dynamic loss scaler, same rules so a migrated fp16 run skips the same steps.

    On overflow the scale halves once ``hysteresis`` overflows have been absorbed; an overflow at
    ``min_scale`` is an error (training cannot recover). The scale doubles after ``window``
    overflow-free steps following the last overflow (the step right after an overflow not counted).
    """

    current_scale: float
    window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_scale: float = 1.0
    factor: float = 2.0
    iteration: int = 0
    last_overflow_iteration: int = -1
    remaining_hysteresis: int = dataclasses.field(init=False)
    dynamic = True

    def __post_init__(self) -> None:
        self.remaining_hysteresis = self.hysteresis

    @property
    def scale(self) -> float:
        return self.current_scale

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.hysteresis == 1 or self.remaining_hysteresis == 1:
                if self.current_scale == self.min_scale:
                    raise FloatingPointError(
                        f"fp16: gradients overflow at the minimum loss scale {self.min_scale:g}; training cannot "
                        "continue (lower the learning rate, use bf16, or lower fp16.min_loss_scale)"
                    )
                old = self.current_scale
                self.current_scale = max(self.current_scale / self.factor, self.min_scale)
                logger.info("fp16 overflow: step skipped, loss scale %g -> %g", old, self.current_scale)
            else:
                self.remaining_hysteresis -= 1
                logger.info(
                    "fp16 overflow: step skipped, loss scale kept at %g (hysteresis: halves after %d more overflow(s))",
                    self.current_scale,
                    self.remaining_hysteresis,
                )
            self.last_overflow_iteration = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.remaining_hysteresis = self.hysteresis
            stable = self.iteration - self.last_overflow_iteration - 1
            if stable > 0 and stable % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.remaining_hysteresis = self.hysteresis
                self.current_scale *= self.factor
        self.iteration += 1

    def state_dict(self) -> dict[str, float | int]:
        return {
            "scale": self.current_scale,
            "iteration": self.iteration,
            "last_overflow_iteration": self.last_overflow_iteration,
            "remaining_hysteresis": self.remaining_hysteresis,
        }

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.current_scale = float(state["scale"])
        self.iteration = int(state["iteration"])
        self.last_overflow_iteration = int(state["last_overflow_iteration"])
        self.remaining_hysteresis = int(state["remaining_hysteresis"])


def build_loss_scaler(precision: str, fp16: FP16Config) -> LossScaler:
    if precision != "fp16":
        return LossScaler()
    if fp16.loss_scale > 0:
        return StaticLossScaler(fp16.loss_scale)
    return DynamicLossScaler(
        current_scale=float(2**fp16.initial_scale_power),
        window=fp16.loss_scale_window,
        hysteresis=fp16.hysteresis,
        consecutive_hysteresis=fp16.consecutive_hysteresis,
        min_scale=fp16.min_loss_scale,
    )
