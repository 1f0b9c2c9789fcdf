"""``slipstream.initialize``: the one call that turns a model and a config into an Engine."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from slipstream.accelerator import Accelerator, get_accelerator
from slipstream.comm import get_rank
from slipstream.engine.data import DistributedDataLoader
from slipstream.engine.engine import Engine, engine_of
from slipstream.engine.lr_schedules import scheduler_for
from slipstream.engine.monitor import TrainingMonitor
from slipstream.engine.no_optimizer import NoOptimizer
from slipstream.engine.options import ConfigSource, EngineOptions, OptimizerSource, engine_options
from slipstream.engine.parallel.mesh import Mesh
from slipstream.engine.parallel.parallelize import Parallelized, parallelize
from slipstream.engine.precision import DTYPES, build_loss_scaler
from slipstream.engine.runners import DirectRunner, PipelineRunner, StepRunner
from slipstream.engine.sharding import shard
from slipstream.engine.zero.init import is_presharded, prepare_presharded
from slipstream.engine.zero.strategy import ShardingStrategy
from slipstream.ops import large_blocks
from slipstream.utils.logging import get_logger, log_rank0

logger = get_logger(__name__)


def initialize(
    model: torch.nn.Module,
    config: ConfigSource,
    *,
    optimizer: OptimizerSource = None,
    model_parameters: Iterable[Any] | None = None,
    lr_scheduler: Any = None,
    training_data: torch.utils.data.Dataset | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    inference: bool = False,
) -> Engine:
    """Wrap ``model`` for training as described by ``config`` (DeepSpeed's schema).

    Joins the process group (see :func:`slipstream.init_distributed`), validates the config
    (:class:`ConfigError` names the key), moves and casts the model, builds the mesh, applies every
    parallelism (one initial weight sync from rank 0 first) and builds the optimizer, LR schedule,
    loss scaler and data loader. ``inference=True`` builds no optimizer and no schedule (the
    config's are ignored, as DeepSpeed's inference path drops them): forward works,
    ``backward``/``step`` raise.

    [Note: one fixed order] As torchtitan's trainer: options (every check, nothing built) → the
    model on its device → mesh → ``parallelize`` → the ZeRO strategy over what remains → the step
    runner of the mode → Engine. Each step reads only the options and what the steps before it made.
    """
    model, compiled_before = _uncompiled(model)
    previous = engine_of(model)
    if previous is not None:  # a model loaded into ZeRO-3 shards keeps them (Engine.close)
        previous.close(for_new_engine=True)
    options = engine_options(
        model, config, optimizer, lr_scheduler, inference, compiled_before
    )  # 1. options: every check, nothing built
    accelerator = get_accelerator()
    cfg = options.config
    if accelerator.device().type == "cpu" and large_blocks.install():  # the model's memory is the host's
        log_rank0(logger, "host memory: blocks of %g MiB or more on their own mappings", large_blocks.installed_mib())
    groups = list(model_parameters) if model_parameters is not None else None  # on the parameters as they are now
    _place_model(model, cfg.precision, accelerator)  # 2. device and dtype (a zero.Init model keeps its shards)
    mesh = Mesh.build(options.sizes)  # 3. the mesh (no process group at all for a data-parallel-only run)
    parallel = parallelize(
        model, mesh, options.parallel
    )  # 4. weight sync, pipeline, experts, tensor, sequence, checkpointing
    if isinstance(options.optimizer, torch.optim.Optimizer):
        parallel.rebind_optimizer(options.optimizer)  # built on the uncut model (a host's create_optimizer)
    strategy = shard(model, options, mesh, parallel.param_groups(groups), accelerator)  # 5. ZeRO over dp·cp·sp
    monitor = TrainingMonitor(cfg, model, accelerator, get_rank(), options.sizes.world, mesh.traffic)
    runner = _runner(parallel, strategy, monitor, cfg)  # 6. how a micro-batch runs
    loader = None
    if training_data is not None:  # sharded by the dp coordinate: ranks that share it read the same batches
        loader = DistributedDataLoader(
            training_data,
            cfg.train_micro_batch_size_per_gpu,
            mesh.rank_of("dp"),
            mesh.size("dp"),
            collate_fn=collate_fn,
            drop_last=cfg.dataloader_drop_last,
        )
    _log_ready(options)
    return Engine(  # 7. the engine, which resumes from the newest checkpoint under checkpoint.auto_resume
        model,
        cfg,
        mesh,
        parallel,
        strategy,
        runner,
        monitor,
        build_loss_scaler(cfg.precision, cfg.fp16),
        accelerator,
        lr_scheduler=scheduler_for(cfg.scheduler, lr_scheduler, strategy.optimizer),
        training_dataloader=loader,
    )


def _uncompiled(model: Any) -> tuple[Any, bool]:
    """The module inside a ``torch.compile``d model, and whether it was compiled.

    [Note: compiled before initialize] Compiling the whole model would trace the engine's hooks
    (ZeRO-3's gathers, the pipeline's boundaries) into its graphs, and its parameters would be named
    ``_orig_mod.*`` in every checkpoint. So the engine takes the module inside and compiles its
    blocks itself, with the ``compile`` section's backend (parallel/compiling.py).
    """
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        return model._orig_mod, True
    return model, False


def _place_model(model: torch.nn.Module, precision: str, accelerator: Accelerator) -> None:
    """The model on the accelerator in the training dtype; a ``zero.Init`` model keeps its shards."""
    dtype = DTYPES[precision] if precision != "fp32" else None
    if is_presharded(model):
        prepare_presharded(model, accelerator.device(), dtype)
    else:
        model.to(device=accelerator.device(), dtype=dtype)


def _runner(parallel: Parallelized, strategy: ShardingStrategy, monitor: TrainingMonitor, cfg: Any) -> StepRunner:
    """The pipeline's runner under a pipeline, the direct one otherwise; floating inputs cast under ``auto_cast``."""
    auto_cast = (cfg.fp16.enabled and cfg.fp16.auto_cast) or (cfg.bf16.enabled and cfg.bf16.auto_cast)
    cast = DTYPES[cfg.precision] if auto_cast else None
    if parallel.pipeline is not None:
        return PipelineRunner(parallel.pipeline, strategy, monitor, cast, parallel.sequence)
    return DirectRunner(parallel.model, strategy, monitor, parallel.sequence, cast, lambda: parallel.compiled)


def _log_ready(options: EngineOptions) -> None:
    cfg, sizes, offload = options.config, options.sizes, options.sharding.offload
    moved = (
        []
        if offload is None
        else [
            f"{what} to {where}"
            for what, where in (("optimizer", offload.optimizer), ("parameters", offload.param))
            if where != "none"
        ]
    )
    if options.optimizer is NoOptimizer:
        optimizer = "no optimizer (forward only)"
    else:
        optimizer = (
            f"optimizer {cfg.optimizer.type}"
            if cfg.optimizer is not None
            else f"optimizer {type(options.optimizer).__name__}"
        )
    log_rank0(
        logger,
        "engine ready: ZeRO stage %d, %s, %s, offload %s, world size %d, batch %d = micro %d × accumulation %d × dp %d",
        options.stage,
        cfg.precision,
        optimizer,
        " and ".join(moved) or "off",
        sizes.world,
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
        sizes.dp,
    )
