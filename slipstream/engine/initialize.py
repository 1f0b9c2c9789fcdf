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
from slipstream.engine.config import AXIS_KEYS, ConfigError, MeshSizes, SlipstreamConfig, mesh_sizes
from slipstream.engine.data import DistributedDataLoader
from slipstream.engine.engine import Engine
from slipstream.engine.optimizers import build_optimizer, validate_optimizer_config
from slipstream.engine.parallel.mesh import DENSE, Mesh
from slipstream.engine.parallel.pipeline import parallelize_pipeline
from slipstream.engine.parallel.pipeline import schedules as pipeline_schedules
from slipstream.engine.parallel.tensor import parallelize_tensor
from slipstream.engine.precision import DTYPES, build_loss_scaler
from slipstream.engine.zero.data_parallel import DataParallelStrategy
from slipstream.engine.zero.offload.options import offload_options
from slipstream.engine.zero.partitioned import PartitionedStrategy
from slipstream.engine.zero.stage3.strategy import Stage3Options, Stage3Strategy
from slipstream.engine.zero.strategy import ParamGroupSpec, ShardingOptions, ShardingStrategy
from slipstream.utils.logging import get_logger, log_rank0

logger = get_logger(__name__)

# The default bucket when reduce_bucket_size is not set: DeepSpeed's 5e8 elements would put a whole
# model in one bucket and leave nothing to overlap with backward (DDP uses 25 MB).
DEFAULT_BUCKET_NUMEL = 25 * 2**20 // 4
AVAILABLE_STAGES = (0, 1, 2, 3)
# The strategy currently attached to each model, so wrapping a model again detaches the old hooks.
# Weak both ways: a strategy refers to its model, so a strong value would keep both alive forever.
# While attached, a strategy is kept alive by its hooks on the model.
_attached: weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref[ShardingStrategy]] = weakref.WeakKeyDictionary()


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
    """Wrap ``model`` for training as described by ``config`` (DeepSpeed's schema).

    Joins the process group (see :func:`slipstream.init_distributed`), validates the config
    (:class:`ConfigError` names the key), moves and casts the model, builds the mesh,
    synchronizes the initial weights from rank 0 and builds the optimizer, LR schedule, loss
    scaler and data loader. ``inference=True`` builds no optimizer and no schedule (the config's are
    ignored, as DeepSpeed's inference path drops them): forward works, ``backward``/``step`` raise.

    [Note: one fixed order] As torchtitan's ``parallelize_llama``: options from the config (every
    check, before anything is built) → prepare the model → build the mesh → (later: cut pipeline
    stages, experts, tensor/sequence/context parallel) → shard (the ZeRO strategy over the dense
    group) → Engine. Each step reads only what the steps before it produced.
    """
    cfg, sizes, optimizer = _options(model, config, optimizer, lr_scheduler, inference)  # 1. options: every check, nothing built
    accelerator = get_accelerator()
    _prepare_model(model, cfg, accelerator)  # 2. device, dtype, activation checkpointing
    mesh = Mesh.build(sizes)  # 3. the mesh (no process group at all for a data-parallel-only run)
    if model_parameters is not None:  # groups built on the parameters as they are now (before any module is swapped)
        model_parameters = list(model_parameters)
    original_names = {id(p): n for n, p in model.named_parameters()}
    pipeline = _parallelize_pipeline(model, cfg, mesh)  # 4a. pipeline: this rank's stages of the model, and their schedule
    experts = _parallelize_experts(model, mesh)  # 4b. expert parallel: this rank's experts, dispatch by all-to-all
    parallelize_tensor(model, cfg, mesh)  # 4c. tensor (+ sequence) parallel over mesh.group("tp")
    sequence = _parallelize_sequence(model, cfg, mesh)  # 4d. Ulysses/ring attention and the engine's input sharding
    if pipeline is not None:
        pipeline.settle()  # tied weights and stand-ins found again after tensor parallel swapped modules
    if model_parameters is not None and (pipeline is not None or mesh.size("tp") > 1 or experts is not None):
        model_parameters = _remap_groups(model_parameters, original_names, model)
    if experts is not None:  # expert parameters sharded over their own group (parallel/expert/parallelize.py)
        model_parameters = experts.split(_as_group_dicts(model_parameters if model_parameters is not None else model.parameters()))
    strategy = _shard(model, cfg, mesh, model_parameters, optimizer, accelerator)  # 5. ZeRO over dp·cp·sp
    scheduler = _build_scheduler(cfg, lr_scheduler, strategy.optimizer)  # 6. the engine and what it holds
    loader = None
    if training_data is not None:  # sharded by the dp coordinate: ranks that share it read the same batches
        loader = DistributedDataLoader(
            training_data, cfg.train_micro_batch_size_per_gpu, mesh.rank_of("dp"), mesh.size("dp"),
            collate_fn=collate_fn, drop_last=cfg.dataloader_drop_last,
        )  # fmt: skip
    log_rank0(
        logger,
        "engine ready: ZeRO stage %d, %s, world size %d, batch %d = micro %d × accumulation %d × dp %d",
        cfg.zero_optimization.stage, cfg.precision, sizes.world, cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps, sizes.dp,
    )  # fmt: skip
    engine = Engine(
        model, cfg, strategy, build_loss_scaler(cfg.precision, cfg.fp16), accelerator, sizes.world,
        lr_scheduler=scheduler, training_dataloader=loader, mesh=mesh,
    )  # fmt: skip
    engine.sequence_sharder = sequence
    engine.pipeline = pipeline
    if experts is not None:
        engine.expert_modules = tuple(experts.modules)
    if cfg.checkpoint.auto_resume:  # the fault-tolerant launcher restarts jobs with this on
        engine.resumed_from, engine.resumed_client_state = engine.checkpoints.resume(engine)
    return engine


# --------------------------------------------------------------------------- 1. options (validation only)


def _options(
    model: torch.nn.Module, config: Any, optimizer: Any, lr_scheduler: Any, inference: bool
) -> tuple[SlipstreamConfig, MeshSizes, Any]:
    """Read and check everything; join the process group (the world size decides the mesh and the triad)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"initialize: model must be a torch.nn.Module, got {type(model).__name__}")
    cfg = SlipstreamConfig.load(config, world_size=None)  # the triad needs the world size: below
    if cfg.log_level:
        get_logger().setLevel(cfg.log_level.upper())
    # An explicit comms_timeout_seconds also re-times a process group the user created; the default does not.
    init_distributed(timeout=cfg.comms_timeout_seconds if "comms_timeout_seconds" in cfg.model_fields_set else None)
    world_size = dist.get_world_size()
    sizes = mesh_sizes(cfg, world_size)
    cfg.resolve_batch_triad(world_size)
    if inference:
        cfg, optimizer = _without_optimizer(cfg, optimizer, lr_scheduler)
    _check_supported(cfg, sizes, optimizer, lr_scheduler)
    _check_model(model, cfg, optimizer)
    _check_sequence_parallel(model, sizes)
    _check_expert_parallel(sizes, optimizer)
    return cfg, sizes, optimizer


def _without_optimizer(cfg: SlipstreamConfig, optimizer: Any, lr_scheduler: Any) -> tuple[SlipstreamConfig, Any]:
    """An engine for evaluation and inference: no optimizer, no schedule, no optimizer state to offload."""
    from slipstream.engine.no_optimizer import NoOptimizer

    if optimizer is not None or lr_scheduler is not None:
        raise ValueError("initialize: inference=True builds no optimizer; do not pass optimizer= or lr_scheduler=")
    # No optimizer state to offload; parameter offload stays where this version allows it alone.
    zero = cfg.zero_optimization.model_copy(update={"offload_optimizer": None, "cpu_offload": None})
    try:
        offload_options(zero, cfg.aio)
    except ValueError:
        zero = zero.model_copy(update={"offload_param": None})
    return cfg.model_copy(update={"optimizer": None, "scheduler": None, "zero_optimization": zero}), NoOptimizer


def _check_supported(cfg: SlipstreamConfig, sizes: MeshSizes, optimizer: Any, lr_scheduler: Any) -> None:
    _check_pipeline(cfg, sizes)
    _check_tensor_parallel(cfg, sizes)
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


def _refuse_together(key: str, size: int, sizes: MeshSizes, axes: tuple[str, ...]) -> None:
    """Combinations of axes not built yet: one error naming every key involved."""
    others = [AXIS_KEYS[a] for a in axes if sizes.size(a) > 1]
    if others:
        raise ConfigError(f"{key}: {size} together with {', '.join(others)} is not supported yet in this version of slipstream")


def _check_pipeline(cfg: SlipstreamConfig, sizes: MeshSizes) -> None:
    """The schedule must be able to run the window's micro-batches on the pipeline's ranks (key-naming errors)."""
    p = sizes.size("pp")
    if p == 1:
        return
    _refuse_together("pipeline.stages", p, sizes, ("sp", "cp", "ep"))
    pipe = cfg.pipeline
    try:
        pipeline_schedules.check(pipe.schedule, p, cfg.gradient_accumulation_steps, pipe.virtual_stages)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _parallelize_pipeline(model: torch.nn.Module, cfg: SlipstreamConfig, mesh: Mesh) -> Any:
    pipe = cfg.pipeline
    try:
        return parallelize_pipeline(
            model, mesh, pipe.schedule, cfg.gradient_accumulation_steps, pipe.virtual_stages, pipe.partition,
            cfg.train_micro_batch_size_per_gpu, twin_check=cfg.twin_check,
        )  # fmt: skip
    except ValueError as err:
        if str(err).startswith("pipeline."):
            raise ConfigError(str(err)) from None
        raise


def _check_expert_parallel(sizes: MeshSizes, optimizer: Any) -> None:
    ep = sizes.size("ep")
    if ep == 1:
        return
    _refuse_together("expert_parallel.autoep_size", ep, sizes, ("tp", "sp", "cp"))
    if isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            "expert_parallel.autoep_size: an optimizer built before initialize() holds the unsharded experts; pass the "
            "optimizer in the config or as a callable, optimizer=lambda params: torch.optim.AdamW(params, ...)"
        )


def _check_sequence_parallel(model: torch.nn.Module, sizes: MeshSizes) -> None:
    """Ulysses splits attention heads over ``u`` ranks: the model's heads must allow it; ring attention needs
    the model's attention seam too (checked before anything is built)."""
    u, c = sizes.size("sp"), sizes.size("cp")
    if u > 1 and c > 1:
        raise ConfigError(
            f"context_parallel.size: {c} with sequence_parallel_size {u}: Ulysses and ring attention together are not "
            "supported yet in this version of slipstream; use one of them"
        )
    if c > 1 and not hasattr(getattr(model, "config", None), "_attn_implementation"):
        raise ConfigError(
            f"context_parallel.size: {c} needs a Hugging Face model that dispatches attention through transformers' "
            f"attention interface (Llama, GPT-2, Mistral, Qwen...); {type(model).__name__} does not"
        )
    if u == 1:
        return
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    if config is None or not hasattr(config, "_attn_implementation") or heads is None:
        raise ConfigError(
            f"sequence_parallel_size: {u} needs a Hugging Face model that dispatches attention through transformers' "
            f"attention interface (Llama, GPT-2, Mistral, Qwen...); {type(model).__name__} does not"
        )
    kv = getattr(config, "num_key_value_heads", None) or heads
    tp = sizes.size("tp")
    if heads % (u * tp):
        raise ConfigError(f"sequence_parallel_size: the model's {heads} attention heads do not divide by {u}{f' × tensor parallel {tp}' if tp > 1 else ''}")
    local_kv = max(kv // tp, 1)
    if local_kv % u and u % local_kv:
        raise ConfigError(
            f"sequence_parallel_size: {local_kv} key/value heads per rank neither divide by {u} nor divide it (they are "
            "split across the group, or repeated when fewer than it)"
        )


def _parallelize_experts(model: torch.nn.Module, mesh: Mesh) -> Any:
    if mesh.size("ep") == 1:
        return None
    from slipstream.engine.parallel.expert import parallelize_experts

    try:
        plan = parallelize_experts(model, mesh)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    log_rank0(logger, "expert parallel %d: %d experts modules, %d expert parameters per rank", mesh.size("ep"), len(plan.modules), len(plan.params))
    return plan


def _remap_groups(params: list[Any], original: dict[int, str], model: torch.nn.Module) -> list[Any]:
    """Parameter groups built before ``initialize`` (decay / no-decay), moved onto the parameters the parallelisms
    put in their place, by name: a tensor-parallel shard for its full weight, nothing for a weight another
    pipeline stage or expert rank holds. A tensor that never was a parameter is left for the strategy to refuse."""
    current = dict(model.named_parameters())
    current_ids = {id(p) for p in current.values()}

    def mapped(p: Any) -> Any:
        if id(p) in current_ids or id(p) not in original:
            return p
        return current.get(original[id(p)])

    if params and isinstance(params[0], dict):
        groups = []
        for group in params:
            members = group["params"] if isinstance(group["params"], (list, tuple)) else [group["params"]]
            kept = [q for q in map(mapped, members) if q is not None]
            if kept:
                groups.append({**group, "params": kept})
        return groups
    return [q for q in map(mapped, params) if q is not None]


def _as_group_dicts(params: Iterable[Any]) -> list[dict[str, Any]]:
    items = list(params)
    return items if items and isinstance(items[0], dict) else [{"params": items}]


def _parallelize_sequence(model: torch.nn.Module, cfg: SlipstreamConfig, mesh: Mesh) -> Any:
    """Ulysses over ``mesh.group("sp")`` or ring attention over ``mesh.group("cp")``: the kernel registered,
    the engine's input sharder that switches the model to it for each step (None when neither is on),
    and the numerical twin check (parallel/twin.py) unless ``twin_check`` is false."""
    from slipstream.engine.parallel.attention import route_attention
    from slipstream.engine.parallel.sequence import SequenceSharder

    if mesh.size("sp") > 1:
        from slipstream.engine.parallel.sequence import ATTENTION_NAME, UlyssesAttention

        group = mesh.group("sp")
        kernel: Any = UlyssesAttention(group)
        previous = route_attention(model, ATTENTION_NAME, kernel, "sequence_parallel_size")
        log_rank0(logger, "sequence parallel (Ulysses) %d: attention %r replaced in each step; batches sharded on the sequence", mesh.size("sp"), previous)
        sharder = SequenceSharder(group, routing=(model, ATTENTION_NAME, previous, kernel))
        mode = f"Ulysses sequence parallel ({mesh.size('sp')})"
    elif mesh.size("cp") > 1:
        from slipstream.engine.parallel.context import AllGatherKVAttention, Layout, RingAttention

        group = mesh.group("cp")
        method = cfg.context_parallel.method
        layout = Layout(mesh.size("cp"), zigzag=method in ("zigzag", "zigzag_ring"))
        kernel = AllGatherKVAttention(group, layout) if method == "allgather_kv" else RingAttention(group, layout)
        previous = route_attention(model, f"slipstream_{method}", kernel, "context_parallel.size")
        log_rank0(logger, "context parallel (%s) %d: attention %r replaced in each step; batches sharded on the sequence", cfg.context_parallel.method, layout.size, previous)
        sharder = SequenceSharder(group, "context_parallel.size", layout, routing=(model, f"slipstream_{method}", previous, kernel))
        mode = f"context parallel ({method}, {layout.size})"
    else:
        return None
    if cfg.twin_check:
        from slipstream.engine.parallel.twin import check_sequence_twin

        try:
            check_sequence_twin(model, sharder, mode)
        except ValueError as err:
            sharder.close()
            raise ConfigError(str(err)) from None
    return sharder


def _check_tensor_parallel(cfg: SlipstreamConfig, sizes: MeshSizes) -> None:
    """The ``tensor_parallel`` section beyond its types (the plan itself is checked when the model is cut)."""
    from slipstream.engine.parallel.tensor import validate_partition_config

    section = cfg.tensor_parallel
    validate_partition_config(section.partition_config)
    if section.sequence_parallel and sizes.tp < 2:
        raise ConfigError("tensor_parallel.sequence_parallel: needs tensor_parallel.autotp_size of 2 or more; set one or remove it")


def _check_model(model: torch.nn.Module, cfg: SlipstreamConfig, optimizer: Any) -> None:
    """What the model and a ready-made optimizer must satisfy before anything is built."""
    from slipstream.engine.zero.init import is_presharded

    if is_presharded(model) and cfg.zero_optimization.stage != 3:
        raise ConfigError("zero_optimization.stage: the model was built under slipstream.zero.Init, which needs stage 3")
    if is_presharded(model) and cfg.tensor_parallel.autotp_size > 1:
        raise ConfigError("tensor_parallel.autotp_size: a model built under slipstream.zero.Init cannot be cut for tensor parallelism; build it normally")
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


# --------------------------------------------------------------------------- 2. prepare the model


def _prepare_model(model: torch.nn.Module, cfg: SlipstreamConfig, accelerator: Any) -> None:
    """Device and dtype (a ``zero.Init`` model keeps its shards), then activation checkpointing."""
    from slipstream.engine.zero.init import is_presharded, prepare_presharded

    dtype = DTYPES[cfg.precision] if cfg.precision != "fp32" else None
    if is_presharded(model):
        prepare_presharded(model, accelerator.device(), dtype)
    else:
        model.to(device=accelerator.device(), dtype=dtype)
    _apply_activation_checkpointing(model, cfg, accelerator.name)


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


# --------------------------------------------------------------------------- 5. shard


def _shard(
    model: torch.nn.Module, cfg: SlipstreamConfig, mesh: Mesh, model_parameters: Iterable[Any] | None,
    optimizer: Any, accelerator: Any,
) -> ShardingStrategy:  # fmt: skip
    """The ZeRO strategy over the dense group (dp·cp·sp), with the optimizer it builds over its shards."""
    groups = ParamGroupSpec.from_user(model_parameters if model_parameters is not None else model.parameters())
    if optimizer is None:
        assert cfg.optimizer is not None
        optimizer_config = cfg.optimizer

        def optimizer_factory(param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
            return build_optimizer(optimizer_config, param_groups, accelerator.supports_fused_adam())

        optimizer = optimizer_factory
    previous = _attached[model]() if model in _attached else None
    if previous is not None and previous.hooks:
        logger.warning("initialize: this model is still attached to an earlier engine; closing that engine's hooks")
        previous.close()
    # None is the default group: a dense group spanning the world is exactly that (no second group).
    group = None if mesh.spans_world(*DENSE) else mesh.dense_group
    strategy = _build_strategy(model, cfg, groups, optimizer, group)
    _attached[model] = weakref.ref(strategy)
    return strategy


def _build_strategy(
    model: torch.nn.Module, cfg: SlipstreamConfig, groups: list[ParamGroupSpec], optimizer: Any,
    group: dist.ProcessGroup | None,
) -> ShardingStrategy:  # fmt: skip
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
        group=group,
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
