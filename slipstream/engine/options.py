"""Step 1 of ``initialize``: the config read, checked and turned into typed, frozen options, before anything is built.

[Note: options, once] Every check that can fail on the config or on the model as given runs here,
so a mistake is refused before any process group, cut or buffer exists, with a
:class:`ConfigError` naming the key raised where the check lives (each parallelism's options class,
the optimizer and schedule tables, the offload rules below). Nothing later re-reads the config to
decide what to build: the steps read these options.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from slipstream.accelerator import get_accelerator
from slipstream.comm import init_distributed
from slipstream.engine.config import AioConfig, ConfigError, MeshSizes, SlipstreamConfig, ZeroConfig, mesh_sizes
from slipstream.engine.config.zero import DEFAULT_REDUCE_BUCKET_NUMEL
from slipstream.engine.optimizers import validate_optimizer_config
from slipstream.engine.parallel.options import ParallelOptions
from slipstream.engine.precision import DTYPES
from slipstream.engine.zero.init import is_presharded
from slipstream.engine.zero.offload.options import AUTO_SUB_GROUP_NUMEL, AioOptions, OffloadOptions
from slipstream.engine.zero.stage3.strategy import Stage3Options
from slipstream.engine.zero.strategy import ShardingOptions
from slipstream.utils.logging import get_logger

ConfigSource = dict[str, Any] | str | os.PathLike[str] | SlipstreamConfig
OptimizerSource = torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer] | None


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """Everything ``initialize`` builds from: the resolved config, the mesh sizes and each step's options."""

    config: SlipstreamConfig
    sizes: MeshSizes
    parallel: ParallelOptions
    sharding: ShardingOptions  # the ZeRO strategy's knobs (its group is the mesh's, set when the mesh exists)
    stage: int
    stage3: Stage3Options | None
    optimizer: OptimizerSource  # the user's optimizer or callable; None: built from config.optimizer


def engine_options(
    model: torch.nn.Module,
    config: ConfigSource,
    optimizer: OptimizerSource,
    lr_scheduler: Any,
    inference: bool,
    compiled_before: bool = False,
) -> EngineOptions:
    """Read and check everything; join the process group (the world size decides the mesh and the batch triad).

    ``compiled_before``: the user passed a ``torch.compile``d model, so compiling is on (initialize's
    [Note: compiled before initialize])."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"initialize: model must be a torch.nn.Module, got {type(model).__name__}")
    cfg = SlipstreamConfig.load(config, world_size=None)  # the triad needs the world size: below
    if cfg.log_level:
        get_logger().setLevel(cfg.log_level.upper())
    if compiled_before and not cfg.compile.on:
        cfg.compile.enabled = True
        get_logger(__name__).info(
            "compile: the model was compiled before initialize; slipstream compiles its blocks instead (backend %s)",
            cfg.compile.backend,
        )
    # An explicit comms_timeout_seconds also re-times a process group the user created; the default does not.
    init_distributed(timeout=cfg.comms_timeout_seconds if "comms_timeout_seconds" in cfg.model_fields_set else None)
    world_size = dist.get_world_size()
    sizes = mesh_sizes(cfg, world_size)
    cfg.resolve_batch_triad(world_size)
    if inference or (optimizer is None and cfg.optimizer is None):
        # No optimizer anywhere builds an engine for forward passes, as DeepSpeed does: TRL's reference
        # models and evaluation-only Trainer runs initialize one at ZeRO-3 to get the parameters gathered.
        cfg, optimizer = _without_optimizer(
            cfg, optimizer, lr_scheduler, "inference=True" if inference else "no optimizer"
        )
    presharded = is_presharded(model)
    parallel = ParallelOptions.from_config(
        cfg,
        sizes,
        model,
        presharded=presharded,
        optimizer_built=isinstance(optimizer, torch.optim.Optimizer),
        device_type=get_accelerator().name,
    )
    zero = cfg.zero_optimization
    sharding = ShardingOptions(
        reduce_bucket_numel=zero.reduce_bucket_size
        if "reduce_bucket_size" in zero.model_fields_set
        else DEFAULT_REDUCE_BUCKET_NUMEL,
        overlap_comm=zero.overlap,
        communication_dtype=DTYPES[cfg.communication_data_type] if cfg.communication_data_type else None,
        gradient_predivide_factor=cfg.gradient_predivide_factor,
        prescale_gradients=cfg.prescale_gradients,
        average=cfg.gradient_allreduce_op == "mean",
        offload=offload_options(zero, cfg.aio),
    )
    _check_optimizer_and_schedule(cfg, optimizer, lr_scheduler)
    _check_model(model, cfg, optimizer, presharded)
    stage3 = None
    if zero.stage == 3:
        stage3 = Stage3Options(
            unit_classes=zero.stage3_unit_modules,
            persistence_threshold=zero.stage3_param_persistence_threshold,
            prefetch_numel=zero.stage3_prefetch_bucket_size,
            max_live_numel=zero.stage3_max_live_parameters,
            max_reuse_numel=zero.stage3_max_reuse_distance,
            hpz_size=zero.zero_hpz_partition_size,
            mics_shard_size=zero.mics_shard_size,
            weight_bits=8 if zero.zero_quantized_weights else 0,
            gradient_bits=4 if zero.zero_quantized_gradients else 0,
        )
    return EngineOptions(cfg, sizes, parallel, sharding, zero.stage, stage3, optimizer)


def offload_options(zero: ZeroConfig, aio: AioConfig) -> OffloadOptions | None:
    """``zero_optimization.offload_*`` and ``aio`` as the strategies use them; None when nothing is offloaded."""
    optimizer_cfg, param_cfg = zero.offload_optimizer, zero.offload_param
    optimizer = optimizer_cfg.device if optimizer_cfg is not None else "none"
    param = param_cfg.device if param_cfg is not None else "none"
    if optimizer == "none" and param == "none":
        return None
    if zero.stage == 0:
        raise ConfigError(
            "zero_optimization.offload_optimizer.device: offload needs ZeRO stage 1, 2 or 3 (the optimizer state "
            "it moves is partitioned); set zero_optimization.stage"
        )
    if param != "none" and zero.stage != 3:
        raise ConfigError(
            f"zero_optimization.offload_param.device: parameter offload needs stage 3, got stage {zero.stage}"
        )
    for name, device, section in (("offload_optimizer", optimizer, optimizer_cfg), ("offload_param", param, param_cfg)):
        if device == "nvme" and not section.nvme_path:  # type: ignore[union-attr]
            raise ConfigError(
                f'zero_optimization.{name}.nvme_path: required when {name}.device is "nvme" (a directory on a local SSD)'
            )
    pins = [
        section.pin_memory for section in (optimizer_cfg, param_cfg) if section is not None and section.device != "none"
    ]
    return OffloadOptions(
        optimizer=optimizer,
        param=param,
        optimizer_nvme_path=optimizer_cfg.nvme_path if optimizer == "nvme" else None,  # type: ignore[union-attr]
        param_nvme_path=param_cfg.nvme_path if param == "nvme" else None,  # type: ignore[union-attr]
        pin_memory=all(pins),
        sub_group_numel=zero.sub_group_size if "sub_group_size" in zero.model_fields_set else AUTO_SUB_GROUP_NUMEL,
        aio=AioOptions(block_size=aio.block_size, threads=max(1, aio.queue_depth) * max(1, aio.intra_op_parallelism)),
    )


def _without_optimizer(
    cfg: SlipstreamConfig, optimizer: Any, lr_scheduler: Any, why: str
) -> tuple[SlipstreamConfig, Any]:
    """An engine for evaluation and inference: no optimizer, no schedule, no optimizer state to offload."""
    from slipstream.engine.no_optimizer import NoOptimizer

    if optimizer is not None or lr_scheduler is not None:
        raise ValueError("initialize: inference=True builds no optimizer; do not pass optimizer= or lr_scheduler=")
    if why == "no optimizer" and cfg.scheduler is not None:
        raise ConfigError(
            'scheduler: a schedule needs an optimizer, and there is none (no "optimizer" section in the config, no '
            "optimizer= to initialize()); add one, or remove the scheduler section for an engine that only runs forward"
        )
    # No optimizer state to offload; parameter offload stays (stage 3), dropped where it is not allowed.
    zero = cfg.zero_optimization.model_copy(update={"offload_optimizer": None, "cpu_offload": None})
    try:
        offload_options(zero, cfg.aio)
    except ConfigError:
        zero = zero.model_copy(update={"offload_param": None})
    return cfg.model_copy(update={"optimizer": None, "scheduler": None, "zero_optimization": zero}), NoOptimizer


def _check_optimizer_and_schedule(cfg: SlipstreamConfig, optimizer: Any, lr_scheduler: Any) -> None:
    if optimizer is not None and cfg.optimizer is not None:
        raise ConfigError("optimizer: given both in the config and as initialize(optimizer=...); keep one")
    if lr_scheduler is not None and cfg.scheduler is not None:
        raise ConfigError("scheduler: given both in the config and as initialize(lr_scheduler=...); keep one")
    if cfg.optimizer is not None:
        validate_optimizer_config(cfg.optimizer)
    if cfg.scheduler is not None:
        from slipstream.engine.lr_schedules import SCHEDULER_PARAMS

        if cfg.scheduler.type not in SCHEDULER_PARAMS:
            raise ConfigError(
                f"scheduler.type: {cfg.scheduler.type!r} is not available; use one of {', '.join(SCHEDULER_PARAMS)}"
            )


def _check_model(model: torch.nn.Module, cfg: SlipstreamConfig, optimizer: Any, presharded: bool) -> None:
    """What the model and a ready-made optimizer must satisfy before anything is built."""
    if presharded and cfg.zero_optimization.stage != 3:
        raise ConfigError(
            "zero_optimization.stage: the model was built under slipstream.zero.Init, which needs stage 3"
        )
    if isinstance(optimizer, torch.optim.Optimizer):
        # An optimizer over other tensors would step them and never the model: a silent no-op.
        own = {id(p) for p in model.parameters()}
        foreign = sum(1 for group in optimizer.param_groups for p in group["params"] if id(p) not in own)
        if foreign:
            raise ConfigError(
                f"optimizer: the optimizer passed to initialize() holds {foreign} tensor(s) that are not parameters of "
                "the model, so training would never update the model; build it over model.parameters() (of this "
                "model object), or pass a callable, optimizer=lambda params: torch.optim.AdamW(params, lr=...)"
            )
