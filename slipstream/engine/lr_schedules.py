"""DeepSpeed-compatible LR schedules: ``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle``.

A ``ds_config.json`` "scheduler" section must give the same learning rates here as under DeepSpeed
0.19.8, so the formulas, defaults and arithmetic order follow DeepSpeed's, quirks included.

[Note: which step an LR belongs to] ``last_batch_iteration`` starts at -1. Building a schedule
writes the value for -1 into the optimizer (the LR of the *first* optimizer step); each ``step()``
then advances the counter and writes the next value. For WarmupLR/WarmupDecayLR the values for -1
and 0 are both ``warmup_min_lr``; WarmupCosineLR gives 0.0 for -1 (not ``warmup_min_ratio``);
OneCycle gives ``cycle_min_lr`` and momentum ``cycle_min_mom`` for -1, then ~``cycle_max_mom`` at 0.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from torch import Tensor
from torch.optim import Optimizer

from slipstream.engine.config import ConfigError, SchedulerConfig, format_validation_error
from slipstream.utils.logging import get_logger

logger = get_logger(__name__)

# DeepSpeed accepts one value for all param groups or a list with one value per group.
PerGroup = float | list[float]


def _non_negative(cls: type, value: PerGroup | None, info: ValidationInfo) -> PerGroup | None:
    values = value if isinstance(value, list) else [value]
    if any(v is not None and v < 0 for v in values):
        raise ValueError("must be >= 0 (a float, or a list with one float per param group)")
    return value


def _total_after_warmup(cls: type, total: int, info: ValidationInfo) -> int:
    # A field validator (not a model one) so the error names total_num_steps; needs warmup_num_steps first.
    warmup = info.data.get("warmup_num_steps")
    if warmup is not None and total <= warmup:
        raise ValueError(f"must be greater than warmup_num_steps ({warmup})")
    return total


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # inf/NaN: ConfigError, never a non-finite run

    last_batch_iteration: int = Field(-1, ge=-1, description="-1 starts the schedule from the beginning")


class _WarmupParams(_Params):
    warmup_min_lr: PerGroup = 0.0
    warmup_num_steps: int = Field(1000, gt=0, description="DeepSpeed raises 1 to 2 (log warmup needs log(n) > 0)")
    warmup_type: Literal["log", "linear"] = "log"

    check_lrs = field_validator("warmup_min_lr", "warmup_max_lr", check_fields=False)(_non_negative)


class WarmupLRParams(_WarmupParams):
    warmup_max_lr: PerGroup | None = Field(None, description="None: each param group's optimizer lr")


class WarmupDecayLRParams(_WarmupParams):
    total_num_steps: int = Field(gt=0)
    # Unlike WarmupLR, DeepSpeed's default here is a fixed 1e-3, not the optimizer's lr.
    warmup_max_lr: PerGroup | None = 0.001

    check_total = field_validator("total_num_steps")(_total_after_warmup)


class WarmupCosineLRParams(_Params):
    """Ratios scale each param group's optimizer lr, so there is no warmup_min_lr/warmup_max_lr."""

    warmup_min_ratio: float = Field(0.0, ge=0.0, le=1.0)
    warmup_num_steps: int = Field(1000, gt=0)
    total_num_steps: int = Field(gt=0)
    cos_min_ratio: float = Field(0.0001, ge=0.0, le=1.0)
    warmup_type: Literal["log", "linear"] = "log"

    check_total = field_validator("total_num_steps")(_total_after_warmup)


class OneCycleParams(_Params):
    cycle_min_lr: PerGroup
    cycle_max_lr: PerGroup
    decay_lr_rate: float = Field(0.0, ge=0.0)
    cycle_first_step_size: int = Field(2000, gt=0)
    cycle_second_step_size: int | None = Field(None, ge=0, description="None: cycle_first_step_size")
    cycle_first_stair_count: int = Field(0, ge=-1, description="<= 0: continuous, no stairs")
    cycle_second_stair_count: int | None = Field(None, ge=-1, description="None: cycle_first_stair_count")
    decay_step_size: int = Field(0, ge=0, description="0: no post-cycle decay")
    cycle_momentum: bool = True
    cycle_min_mom: PerGroup = 0.8
    cycle_max_mom: PerGroup = 0.9
    decay_mom_rate: float = Field(0.0, ge=0.0)

    check_values = field_validator("cycle_min_lr", "cycle_max_lr", "cycle_min_mom", "cycle_max_mom")(_non_negative)


SCHEDULER_PARAMS: dict[str, type[BaseModel]] = {
    "WarmupLR": WarmupLRParams,
    "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams,
    "OneCycle": OneCycleParams,
}


def _per_group(value: PerGroup, optimizer: Optimizer, name: str) -> list[float]:
    n = len(optimizer.param_groups)
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{name}: expected one value per param group ({n}), got a list of {len(value)}")
        return [float(v) for v in value]
    return [float(value)] * n


class LRSchedule:
    """Base of the schedules: the step counter, writes into the optimizer, state. Subclasses give values."""

    def __init__(self, optimizer: Optimizer, last_batch_iteration: int) -> None:
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = [float(g["lr"]) for g in optimizer.param_groups]
        # DeepSpeed only touches the optimizer at construction when starting from the beginning.
        if last_batch_iteration == -1:
            self._apply()

    def _lrs(self, it: int) -> list[float]:
        raise NotImplementedError

    def _betas(self, it: int) -> list[tuple[float, float]] | None:
        return None

    def _apply(self) -> None:
        it = self.last_batch_iteration
        self._last_lr = self._lrs(it)
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            if isinstance(group["lr"], Tensor):  # tensor lrs (capturable/compiled optimizers) stay tensors
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        betas = self._betas(it)
        if betas is not None:
            for group, b in zip(self.optimizer.param_groups, betas):
                group["betas"] = b

    def step(self) -> None:
        """Advance one optimizer step and write the new lr (and momentum) into every param group."""
        self.last_batch_iteration += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return list(self._last_lr)

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        # DeepSpeed relies on the optimizer's own state for the current lr; rewriting it keeps the
        # trajectory right even when the optimizer state was not (or not yet) loaded.
        self.last_batch_iteration = int(state["last_batch_iteration"])
        self._apply()


def _warmup_gamma(it: int, steps: int, kind: str) -> float:
    """Warmup progress in [0, 1) for iteration ``it`` < ``steps``, DeepSpeed's arithmetic order."""
    if kind == "log":
        return 1.0 / math.log(steps) * math.log(it + 1)
    return it / steps


class WarmupLR(LRSchedule):
    """Warm up from warmup_min_lr to warmup_max_lr over warmup_num_steps, then hold."""

    def __init__(self, optimizer: Optimizer, params: WarmupLRParams) -> None:
        max_lr = params.warmup_max_lr
        if max_lr is None:
            max_lr = [float(g["lr"]) for g in optimizer.param_groups]
        self.min_lrs = _per_group(params.warmup_min_lr, optimizer, "warmup_min_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(_per_group(max_lr, optimizer, "warmup_max_lr"), self.min_lrs)]
        self.warmup_num_steps = max(2, params.warmup_num_steps)
        self.warmup_type = params.warmup_type
        super().__init__(optimizer, params.last_batch_iteration)

    def _gamma(self, it: int) -> float:
        if it < self.warmup_num_steps:
            return _warmup_gamma(it, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def _lrs(self, it: int) -> list[float]:
        if it < 0:
            return list(self.min_lrs)
        gamma = self._gamma(it)
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay that reaches 0 at total_num_steps."""

    def __init__(self, optimizer: Optimizer, params: WarmupDecayLRParams) -> None:
        self.total_num_steps = params.total_num_steps
        super().__init__(optimizer, params)  # type: ignore[arg-type]  # same warmup fields

    def _gamma(self, it: int) -> float:
        if it < self.warmup_num_steps:
            return super()._gamma(it)
        decay_steps = float(max(1.0, self.total_num_steps - self.warmup_num_steps))
        return max(0.0, float(self.total_num_steps - it) / decay_steps)


class WarmupCosineLR(LRSchedule):
    """Scale each group's optimizer lr: warm up from warmup_min_ratio to 1, cosine down to cos_min_ratio.

    The base lrs are read from the optimizer at construction, so build the schedule before loading
    optimizer state (as DeepSpeed does).
    """

    def __init__(self, optimizer: Optimizer, params: WarmupCosineLRParams) -> None:
        self.p = params
        self.warmup_num_steps = max(2, params.warmup_num_steps)
        self.base_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        super().__init__(optimizer, params.last_batch_iteration)

    def _ratio(self, it: int) -> float:
        if it < 0:
            return 0.0
        if it < self.warmup_num_steps:
            gamma = _warmup_gamma(it, self.warmup_num_steps, self.p.warmup_type)
            return self.p.warmup_min_ratio + gamma * (1.0 - self.p.warmup_min_ratio)
        # The first post-warmup iteration is already one step into the cosine; clamp past the end.
        decay_steps = max(1, self.p.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, (it - self.warmup_num_steps + 1) / decay_steps)
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.p.cos_min_ratio + (1.0 - self.p.cos_min_ratio) * cosine)

    def _lrs(self, it: int) -> list[float]:
        ratio = self._ratio(it)
        return [base * ratio for base in self.base_lrs]


class OneCycle(LRSchedule):
    """1Cycle: lr rises min -> max over the first half-cycle, falls back over the second, then decays.

    With ``cycle_momentum``, Adam-style ``betas[0]`` cycles inversely (max_mom -> min_mom -> max_mom).
    DeepSpeed only cycles optimizers whose defaults have ``betas`` (so not SGD's ``momentum``), and it
    writes ``betas = (mom, 0.99)``, replacing beta2; we do the same so the trajectories match.
    """

    def __init__(self, optimizer: Optimizer, params: OneCycleParams) -> None:
        p = params
        self.first = float(p.cycle_first_step_size)
        self.second = float(p.cycle_second_step_size) if p.cycle_second_step_size is not None else self.first
        self.total_size = self.first + self.second
        self.step_ratio = self.first / self.total_size
        self.first_stairs = p.cycle_first_stair_count
        self.second_stairs = self.first_stairs if p.cycle_second_stair_count is None else p.cycle_second_stair_count
        self.decay_step_size = p.decay_step_size
        self.decay_lr_rate, self.decay_mom_rate = p.decay_lr_rate, p.decay_mom_rate
        self.min_lrs = _per_group(p.cycle_min_lr, optimizer, "cycle_min_lr")
        self.max_lrs = _per_group(p.cycle_max_lr, optimizer, "cycle_max_lr")
        self.cycle_momentum = p.cycle_momentum and "betas" in optimizer.defaults
        if p.cycle_momentum and not self.cycle_momentum:
            logger.warning(
                "OneCycle: cycle_momentum is off: %s has no 'betas' (as in DeepSpeed)", type(optimizer).__name__
            )
        self.min_moms = _per_group(p.cycle_min_mom, optimizer, "cycle_min_mom")
        self.max_moms = _per_group(p.cycle_max_mom, optimizer, "cycle_max_mom")
        super().__init__(optimizer, p.last_batch_iteration)

    def _scale(self, it: int) -> float:
        """Position in the cycle as a fraction of the amplitude (0 at min lr, 1 at max lr)."""
        b = it + 1
        cycle = math.floor(1 + b / self.total_size)
        x = 1.0 + b / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stairs
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stairs
        if stairs > 0:
            # Stairs from the integer offset, not from `scale`, whose rounding could drop a stair.
            pos = b % self.total_size
            if pos <= self.first:
                position = pos * stairs / self.first
            else:
                position = (self.total_size - pos) * stairs / self.second
            scale = math.floor(position) / stairs
        return scale

    def _decay_factor(self, it: int, rate: float) -> float | None:
        if self.decay_step_size == 0 or rate == 0:
            return None
        return 1 + rate * ((it - self.total_size + 1) / self.decay_step_size)

    def _lrs(self, it: int) -> list[float]:
        if it < 0:
            return list(self.min_lrs)
        if it < self.total_size:
            scale = self._scale(it)
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        factor = self._decay_factor(it, self.decay_lr_rate)
        return list(self.min_lrs) if factor is None else [lo / factor for lo in self.min_lrs]

    def _betas(self, it: int) -> list[tuple[float, float]] | None:
        if not self.cycle_momentum:
            return None
        if it < 0:
            moms = list(self.min_moms)
        elif it < self.total_size:
            scale = self._scale(it)
            moms = [hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms)]
        else:
            # DeepSpeed multiplies here (momentum grows after the cycle) where the lr divides.
            factor = self._decay_factor(it, self.decay_mom_rate)
            moms = list(self.max_moms) if factor is None else [hi * factor for hi in self.max_moms]
        return [(m, 0.99) for m in moms]


_SCHEDULES: dict[str, type[LRSchedule]] = {c.__name__: c for c in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle)}


def build_lr_scheduler(type_name: str, params: dict | BaseModel, optimizer: Optimizer) -> LRSchedule:
    """Build a schedule from a config "scheduler" section (raw dicts are validated first)."""
    if type_name not in _SCHEDULES:
        raise ValueError(f"scheduler.type must be one of {', '.join(_SCHEDULES)}, got {type_name!r}")
    model = SCHEDULER_PARAMS[type_name]
    if isinstance(params, dict):
        params = model.model_validate(params)
    elif not isinstance(params, model):
        raise TypeError(f"{type_name} expects {model.__name__} params, got {type(params).__name__}")
    return _SCHEDULES[type_name](optimizer, params)  # type: ignore[arg-type]


def scheduler_for(config: SchedulerConfig | None, given: Any, optimizer: Optimizer) -> Any:
    """The engine's schedule: the config's ``scheduler`` section, or the user's schedule (or a callable ``optimizer -> schedule``).

    :class:`ConfigError` naming ``scheduler.params`` for parameters the schedule refuses.
    """
    if config is not None:
        from pydantic import ValidationError

        try:
            return build_lr_scheduler(config.type, config.params, optimizer)
        except ValidationError as err:
            raise ConfigError(
                format_validation_error(err, SCHEDULER_PARAMS[config.type], prefix="scheduler.params")
            ) from None
        except (ValueError, TypeError) as err:  # e.g. a per-group lr list of the wrong length
            raise ConfigError(f"scheduler.params: {err}") from None
    if callable(given) and not hasattr(given, "step"):
        return given(optimizer)
    return given
