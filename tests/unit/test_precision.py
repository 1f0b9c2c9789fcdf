"""fp16 loss scaling follows DeepSpeed's dynamic loss scaler rules."""

import pytest

from slipstream.engine.config import FP16Config
from slipstream.engine.precision import DynamicLossScaler, LossScaler, StaticLossScaler, build_loss_scaler


def test_builds_the_right_scaler() -> None:
    assert type(build_loss_scaler("bf16", FP16Config())) is LossScaler
    assert isinstance(build_loss_scaler("fp16", FP16Config(loss_scale=128)), StaticLossScaler)
    dynamic = build_loss_scaler("fp16", FP16Config(initial_scale_power=12))
    assert isinstance(dynamic, DynamicLossScaler) and dynamic.scale == 4096


def test_overflow_halves_after_hysteresis_down_to_min_then_fails() -> None:
    scaler = DynamicLossScaler(current_scale=8.0, window=100, hysteresis=2, min_scale=2.0)
    scaler.update(True)
    assert scaler.scale == 8.0  # first overflow absorbed by hysteresis
    scaler.update(True)
    assert scaler.scale == 4.0
    scaler.update(True)
    assert scaler.scale == 2.0  # hysteresis stays spent until a window passes cleanly
    with pytest.raises(FloatingPointError, match="minimum loss scale 2"):
        scaler.update(True)


def test_scale_grows_after_a_clean_window() -> None:
    scaler = DynamicLossScaler(current_scale=16.0, window=3, hysteresis=1)
    scaler.update(True)  # iteration 0 overflows
    assert scaler.scale == 8.0
    for _ in range(3):
        scaler.update(False)
    assert scaler.scale == 8.0
    scaler.update(False)  # DeepSpeed 0.19.8 does not count the first clean step after an overflow
    assert scaler.scale == 16.0


def test_first_growth_matches_deepspeed_timing() -> None:
    # Checked against deepspeed 0.19.8's DynamicLossScaler: with no overflow the first doubling comes
    # at update number window+1, then every window updates.
    scaler = DynamicLossScaler(current_scale=1.0, window=4)
    scales = []
    for _ in range(9):
        scaler.update(False)
        scales.append(scaler.scale)
    assert scales == [1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0, 4.0]


def test_state_round_trip() -> None:
    scaler = DynamicLossScaler(current_scale=64.0, window=5, hysteresis=2)
    scaler.update(True)
    scaler.update(False)
    restored = DynamicLossScaler(current_scale=1.0, window=5, hysteresis=2)
    restored.load_state_dict(scaler.state_dict())
    for overflow in (True, False, False, True, True):
        scaler.update(overflow)
        restored.update(overflow)
        assert restored.scale == scaler.scale
