"""Optimizers named in the config, with DeepSpeed's meaning for each name.

DeepSpeed's ``"Adam"`` is decoupled-weight-decay Adam (``adam_w_mode`` defaults to true) and its
weight decay defaults to 0 — unlike ``torch.optim.AdamW``'s 0.01. We keep DeepSpeed's meaning so a
migrated config trains the same model.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from slipstream.engine.config import ConfigError, OptimizerConfig, did_you_mean, format_validation_error


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # inf/NaN: ConfigError, never a non-finite run


class AdamParams(_Params):
    lr: float = Field(1e-3, gt=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    amsgrad: bool = False
    adam_w_mode: bool = True
    bias_correction: bool = True
    torch_adam: bool = False  # accepted for compatibility: we always use torch's (fused) Adam here
    fused: bool | None = None  # None: fused kernels where the device supports them


class SGDParams(_Params):
    lr: float = Field(gt=0.0)
    momentum: float = Field(0.0, ge=0.0)
    dampening: float = 0.0
    weight_decay: float = Field(0.0, ge=0.0)
    nesterov: bool = False


OPTIMIZER_PARAMS: dict[str, type[_Params]] = {"adam": AdamParams, "adamw": AdamParams, "sgd": SGDParams}


def validate_optimizer_config(config: OptimizerConfig) -> _Params:
    kind = config.type.lower()
    if kind not in OPTIMIZER_PARAMS:
        hint = did_you_mean(config.type, ["Adam", "AdamW", "SGD"])
        raise ConfigError(
            f"optimizer.type: {config.type!r} is not available; use Adam, AdamW or SGD, or pass optimizer= to "
            f"initialize(){hint if 'did you mean' in hint else ''}"
        )
    try:
        return OPTIMIZER_PARAMS[kind].model_validate(config.params)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, OPTIMIZER_PARAMS[kind], prefix="optimizer.params")) from None


def build_optimizer(
    config: OptimizerConfig, groups: list[dict[str, Any]], fused_supported: bool
) -> torch.optim.Optimizer:
    """Instantiate the configured optimizer over ``groups`` (dicts with ``params`` and overrides)."""
    params = validate_optimizer_config(config)
    kind = config.type.lower()
    if isinstance(params, SGDParams):
        return torch.optim.SGD(groups, **params.model_dump())
    assert isinstance(params, AdamParams)
    if not params.bias_correction:
        raise ConfigError("optimizer.params.bias_correction: false is not supported; remove it")
    decoupled = kind == "adamw" or params.adam_w_mode
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    fused = fused_supported if params.fused is None else params.fused
    if fused and not params.amsgrad and any(p.is_cuda for group in groups for p in group["params"]):
        from slipstream.ops.adam import FusedAdam, fused_adam_available

        if fused_adam_available():  # our multi-tensor kernel; else torch's fused AdamW below
            return FusedAdam(
                groups,
                lr=params.lr,
                betas=params.betas,
                eps=params.eps,
                weight_decay=params.weight_decay,
                adamw_mode=decoupled,
            )
    options: dict[str, Any] = dict(
        lr=params.lr, betas=params.betas, eps=params.eps, weight_decay=params.weight_decay, amsgrad=params.amsgrad
    )
    options["fused" if fused else "foreach"] = True
    return cls(groups, **options)
