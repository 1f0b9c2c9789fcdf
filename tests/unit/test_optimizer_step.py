"""The update at a boundary (slipstream/engine/optimizer_step.py): the device path, which never reads the norm on the
host, scales the gradients by the same coefficient as the host path, with and without clipping and loss scaling."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from slipstream.engine.optimizer_step import OptimizerStep
from slipstream.engine.precision import LossScaler, StaticLossScaler


class _Strategy:
    """What OptimizerStep asks of a strategy, recording the factor it scales the gradients by."""

    def __init__(self, norm: float) -> None:
        self.norm, self.factors, self.steps = norm, [], 0

    def global_grad_norm(self) -> torch.Tensor:
        return torch.tensor(self.norm, dtype=torch.float32)

    def scale_gradients(self, factor: Any) -> None:
        self.factors.append(factor)

    def step(self) -> None:
        self.steps += 1

    def zero_grad(self) -> None:
        pass


def _run(norm: float, clip: float, scaler: LossScaler, check: bool, ahead: bool) -> tuple[Any, Any, _Strategy]:
    strategy = _Strategy(norm)
    update = OptimizerStep(strategy, scaler, clip, check, lambda: None, ahead)  # type: ignore[arg-type]
    result = update(None, 0)
    return result.grad_norm, strategy.factors, strategy


@pytest.mark.parametrize("clip", [0.0, 1.0, 100.0])
@pytest.mark.parametrize("scale", [1.0, 1024.0])
@pytest.mark.parametrize("norm", [0.37, 37.0])
def test_the_device_path_scales_as_the_host_path(clip: float, scale: float, norm: float) -> None:
    scaler = LossScaler() if scale == 1.0 else StaticLossScaler(scale)
    host_norm, host_factors, _ = _run(norm, clip, scaler, check=False, ahead=False)
    device_norm, device_factors, _ = _run(norm, clip, scaler, check=False, ahead=True)
    assert isinstance(host_norm, float) and isinstance(host_factors[0], float)
    assert isinstance(device_norm, torch.Tensor)  # never read on the host
    assert float(device_norm) == pytest.approx(host_norm, rel=1e-6)
    assert float(device_factors[0]) == pytest.approx(host_factors[0], rel=1e-6)
    expected = (1 / scale) * (min(1.0, clip / (norm / scale + 1e-6)) if clip else 1.0)
    assert float(device_factors[0]) == pytest.approx(expected, rel=1e-6)


def test_the_overflow_check_reads_the_norm_and_skips_the_step_even_where_the_device_runs_ahead() -> None:
    norm, factors, strategy = _run(math.inf, 1.0, StaticLossScaler(8.0), check=True, ahead=True)
    assert isinstance(norm, float) and math.isinf(norm)
    assert factors == [] and strategy.steps == 0
