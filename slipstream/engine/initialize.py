"""``slipstream.initialize``: the one call that turns a model and a config into an Engine."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from slipstream.accelerator import get_accelerator
from slipstream.comm import init_distributed
from slipstream.engine.config import ConfigError, SlipstreamConfig
from slipstream.engine.data import DistributedDataLoader
from slipstream.engine.engine import Engine
from slipstream.engine.optimizers import build_optimizer, validate_optimizer_config
from slipstream.engine.precision import DTYPES, build_loss_scaler
from slipstream.engine.zero.data_parallel import DataParallelStrategy
from slipstream.engine.zero.offload.options import offload_options
from slipstream.engine.zero.partitioned import PartitionedStrategy
from slipstream.engine.zero.stage3 import Stage3Options, Stage3Strategy
from slipstream.engine.zero.strategy import ParamGroupSpec, ShardingOptions, ShardingStrategy
from slipstream.utils.logging import get_logger, log_rank0

logger = get_logger(__name__)

# The default bucket when reduce_bucket_size is not set: DeepSpeed's 5e8 elements would put a whole
# model in one bucket and leave nothing to overlap with backward (DDP uses 25 MB).
DEFAULT_BUCKET_NUMEL = 25 * 2**20 // 4
AVAILABLE_STAGES = (0, 1, 2, 3)

# The strategy currently attached to each model, so wrapping a model again detaches the old hooks.
_attached: weakref.WeakKeyDictionary[torch.nn.Module, ShardingStrategy] = weakref.WeakKeyDictionary()


def initialize(
    model: torch.nn.Module,
    config: dict[str, Any] | str | os.PathLike[str] | SlipstreamConfig,
    *,
    optimizer: torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer] | None = None,
    model_parameters: Iterable[Any] | None = None,
    lr_scheduler: Any = None,
    training_data: torch.utils.data.Dataset | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    inference: bool = False,
) -> Engine:
    """Wrap ``model`` for data-parallel training as described by ``config`` (DeepSpeed's schema).

    Joins the process group (see :func:`slipstream.init_distributed`), validates the config
    (:class:`ConfigError` names the key), moves and casts the model, synchronizes its initial
    weights from rank 0 and builds the optimizer, LR schedule, loss scaler and data loader.
    ``inference=True`` builds no optimizer and no schedule (the config's are ignored, as DeepSpeed's
    inference path drops them): forward works, ``backward``/``step`` raise.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"initialize: model must be a torch.nn.Module, got {type(model).__name__}")
    cfg = SlipstreamConfig.load(config, world_size=None)  # the triad needs the world size: below
    if cfg.log_level:
        get_logger().setLevel(cfg.log_level.upper())
    # An explicit comms_timeout_seconds also re-times a process group the user created; the default does not.
    init_distributed(timeout=cfg.comms_timeout_seconds if "comms_timeout_seconds" in cfg.model_fields_set else None)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    cfg.resolve_batch_triad(world_size)
    # --- integrations (issue 15): an engine without an optimizer, for evaluation and inference
    if inference:
        from slipstream.engine.no_optimizer import NoOptimizer

        if optimizer is not None or lr_scheduler is not None:
            raise ValueError("initialize: inference=True builds no optimizer; do not pass optimizer= or lr_scheduler=")
        # No optimizer state to offload; parameter offload stays where this version allows it alone.
        zero = cfg.zero_optimization.model_copy(update={"offload_optimizer": None, "cpu_offload": None})
        try:
            offload_options(zero, cfg.aio)
        except ValueError:
            zero = zero.model_copy(update={"offload_param": None})
        cfg = cfg.model_copy(update={"optimizer": None, "scheduler": None, "zero_optimization": zero})
        optimizer = NoOptimizer
    # --- end integrations
    _check_supported(cfg, optimizer, lr_scheduler)

    accelerator = get_accelerator()
    dtype = DTYPES[cfg.precision] if cfg.precision != "fp32" else None
    from slipstream.engine.zero.init import is_presharded, prepare_presharded

    if is_presharded(model):
        if cfg.zero_optimization.stage != 3:
            raise ConfigError("zero_optimization.stage: the model was built under slipstream.zero.Init, which needs stage 3")
        prepare_presharded(model, accelerator.device(), dtype)
    else:
        model.to(device=accelerator.device(), dtype=dtype)
    _apply_activation_checkpointing(model, cfg, accelerator.name)
    groups = ParamGroupSpec.from_user(model_parameters if model_parameters is not None else model.parameters())
    if optimizer is None:
        assert cfg.optimizer is not None
        optimizer_config = cfg.optimizer

        def optimizer_factory(param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
            return build_optimizer(optimizer_config, param_groups, accelerator.supports_fused_adam())

        optimizer = optimizer_factory
    previous = _attached.get(model)
    if previous is not None and previous.hooks:
        logger.warning("initialize: this model is still attached to an earlier engine; closing that engine's hooks")
        previous.close()
    strategy = _attached[model] = _build_strategy(model, cfg, groups, optimizer)
    scheduler = _build_scheduler(cfg, lr_scheduler, strategy.optimizer)
    loader = None
    if training_data is not None:
        loader = DistributedDataLoader(
            training_data, cfg.train_micro_batch_size_per_gpu, rank, world_size,
            collate_fn=collate_fn, drop_last=cfg.dataloader_drop_last,
        )  # fmt: skip
    log_rank0(
        logger,
        "engine ready: ZeRO stage %d, %s, world size %d, batch %d = micro %d × accumulation %d × %d ranks",
        cfg.zero_optimization.stage, cfg.precision, world_size, cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps, world_size,
    )  # fmt: skip
    engine = Engine(
        model, cfg, strategy, build_loss_scaler(cfg.precision, cfg.fp16), accelerator, world_size,
        lr_scheduler=scheduler, training_dataloader=loader,
    )  # fmt: skip
    if cfg.checkpoint.auto_resume:  # the fault-tolerant launcher restarts jobs with this on
        engine.resumed_from, engine.resumed_client_state = engine.checkpoints.resume(engine)
    return engine


def _check_supported(cfg: SlipstreamConfig, optimizer: Any, lr_scheduler: Any) -> None:
    zero = cfg.zero_optimization
    if zero.stage not in AVAILABLE_STAGES:
        raise ConfigError(
            f"zero_optimization.stage: stage {zero.stage} is not available in this version of slipstream yet "
            f"(available: {', '.join(map(str, AVAILABLE_STAGES))})"
        )
    try:
        offload_options(zero, cfg.aio)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if optimizer is None and cfg.optimizer is None:
        raise ConfigError("optimizer: not set; add an \"optimizer\" section to the config or pass optimizer= to initialize()")
    if optimizer is not None and cfg.optimizer is not None:
        raise ConfigError("optimizer: given both in the config and as initialize(optimizer=...); keep one")
    if lr_scheduler is not None and cfg.scheduler is not None:
        raise ConfigError("scheduler: given both in the config and as initialize(lr_scheduler=...); keep one")
    if cfg.optimizer is not None:
        validate_optimizer_config(cfg.optimizer)
    if cfg.scheduler is not None:
        from slipstream.engine.schedules import SCHEDULER_PARAMS

        if cfg.scheduler.type not in SCHEDULER_PARAMS:
            raise ConfigError(
                f"scheduler.type: {cfg.scheduler.type!r} is not available; use one of {', '.join(SCHEDULER_PARAMS)}"
            )


def _apply_activation_checkpointing(model: torch.nn.Module, cfg: SlipstreamConfig, device_type: str) -> None:
    """Set the defaults of ``slipstream.checkpointing.checkpoint`` and wrap ``module_classes`` (docs/activation_checkpointing.md)."""
    from slipstream import checkpointing

    section = cfg.activation_checkpointing
    checkpointing.configure(
        cpu_checkpointing=section.cpu_checkpointing, use_reentrant=section.use_reentrant,
        synchronize_checkpoint_boundary=section.synchronize_checkpoint_boundary,
    )  # fmt: skip
    if section.cpu_checkpointing and device_type == "cpu":
        log_rank0(logger, "activation_checkpointing.cpu_checkpointing: the device is the CPU, so saved activations already live in host memory; nothing to offload")
    if not section.module_classes:
        if section.number_checkpoints is not None:
            logger.warning("activation_checkpointing.number_checkpoints: only applies with module_classes; ignored")
        return
    try:
        names = checkpointing.apply_activation_checkpointing(
            model, section.module_classes, section.number_checkpoints, section.cpu_checkpointing
        )
    except ValueError as err:
        raise ConfigError(str(err)) from None
    log_rank0(logger, "activation checkpointing: %d modules (%s%s)", len(names), ", ".join(names[:3]), ", ..." if len(names) > 3 else "")


def _build_strategy(
    model: torch.nn.Module, cfg: SlipstreamConfig, groups: list[ParamGroupSpec], optimizer: Any
) -> ShardingStrategy:
    zero = cfg.zero_optimization
    bucket = zero.reduce_bucket_size if "reduce_bucket_size" in zero.model_fields_set else DEFAULT_BUCKET_NUMEL
    options = ShardingOptions(
        reduce_bucket_numel=bucket,
        overlap_comm=zero.overlap,
        communication_dtype=DTYPES[cfg.communication_data_type] if cfg.communication_data_type else None,
        gradient_predivide_factor=cfg.gradient_predivide_factor,
        prescale_gradients=cfg.prescale_gradients,
        average=cfg.gradient_allreduce_op == "mean",
        offload=offload_options(zero, cfg.aio),
    )
    if zero.stage == 0:
        return DataParallelStrategy(model, groups, options, optimizer)
    if zero.stage == 3:
        from slipstream.engine.zero.init import take_preshard

        stage3 = Stage3Options(
            unit_classes=zero.stage3_unit_modules,
            persistence_threshold=zero.stage3_param_persistence_threshold,
            prefetch_numel=zero.stage3_prefetch_bucket_size,
            max_live_numel=zero.stage3_max_live_parameters,
        )
        try:
            return Stage3Strategy(model, groups, options, optimizer, stage3, preshard=take_preshard(model))
        except ValueError as err:
            if str(err).startswith(("zero_optimization.", "optimizer")):
                raise ConfigError(str(err)) from None
            raise
    try:
        return PartitionedStrategy(model, groups, options, optimizer, stage=zero.stage)
    except ValueError as err:
        if str(err).startswith(("zero_optimization.", "optimizer")):
            raise ConfigError(str(err)) from None
        raise


def _build_scheduler(cfg: SlipstreamConfig, lr_scheduler: Any, optimizer: torch.optim.Optimizer) -> Any:
    if cfg.scheduler is not None:
        from pydantic import ValidationError

        from slipstream.engine.config import format_validation_error
        from slipstream.engine.schedules import SCHEDULER_PARAMS, build_lr_scheduler

        try:
            return build_lr_scheduler(cfg.scheduler.type, cfg.scheduler.params, optimizer)
        except ValidationError as err:
            model = SCHEDULER_PARAMS[cfg.scheduler.type]
            raise ConfigError(format_validation_error(err, model, prefix="scheduler.params")) from None
        except (ValueError, TypeError) as err:  # e.g. a per-group lr list of the wrong length
            raise ConfigError(f"scheduler.params: {err}") from None
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        return lr_scheduler(optimizer)
    return lr_scheduler
