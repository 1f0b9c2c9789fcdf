"""The configuration: DeepSpeed's JSON schema, parsed once into typed pydantic models.

Existing ``ds_config.json`` files work unchanged. Every mistake becomes a :class:`ConfigError`
naming the key path, the bad value and what is allowed; ``"auto"`` values are resolved here,
explicitly, and logged (DeepSpeed drops them silently).
"""

from __future__ import annotations

import difflib
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import hjson
from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    BeforeValidator,
    ValidationError,
    field_validator,
    model_validator,
)

from slipstream.utils.logging import get_logger

logger = get_logger(__name__)

AUTO = "auto"


class ConfigError(ValueError):
    """A configuration mistake; the message names the key path, the value and the fix."""


class Section(BaseModel):
    """Base for every config section: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_assignment=True)


def _unsupported(value: Any, default: Any, what: str) -> Any:
    if value != default:
        raise ValueError(f"{what} is not supported by slipstream; remove the key or set it to {default!r}")
    return value


# --------------------------------------------------------------------------- sections


class OptimizerConfig(Section):
    """``optimizer``: the type is matched case-insensitively; params are validated per type."""

    type: str
    params: dict[str, Any] = Field(default_factory=dict)


class SchedulerConfig(Section):
    type: str
    params: dict[str, Any] = Field(default_factory=dict)


class FP16Config(Section):
    enabled: bool = False
    auto_cast: bool = False
    loss_scale: float = Field(0.0, ge=0.0, description="0 selects dynamic loss scaling")
    initial_scale_power: int = Field(16, ge=0, le=64)
    loss_scale_window: int = Field(1000, ge=1)
    hysteresis: int = Field(2, ge=1)
    consecutive_hysteresis: bool = False
    min_loss_scale: float = Field(1.0, gt=0.0)
    fp16_master_weights_and_grads: bool = False

    @field_validator("fp16_master_weights_and_grads")
    @classmethod
    def _no_fp16_masters(cls, v: bool) -> bool:
        return _unsupported(v, False, "fp16 master weights")


class BF16Config(Section):
    enabled: bool = False
    auto_cast: bool = False  # slipstream's: cast floating-point forward inputs to bf16 (as fp16.auto_cast)
    immediate_grad_update: bool = False
    check_grad_overflow: bool = True
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False

    @field_validator("bf16_master_weights_and_grads", "bf16_optimizer_states")
    @classmethod
    def _fp32_masters_only(cls, v: bool) -> bool:
        return _unsupported(v, False, "bf16 master weights / optimizer states (slipstream keeps them in fp32)")


class TorchAutocastConfig(Section):
    enabled: bool = False
    dtype: str | None = None
    lower_precision_safe_modules: list[str] | None = None

    @field_validator("enabled")
    @classmethod
    def _no_autocast(cls, v: bool) -> bool:
        return _unsupported(v, False, "torch_autocast (use bf16 or fp16)")


class OffloadOptimizerConfig(Section):
    device: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: str | None = None
    buffer_count: int = Field(4, ge=1)
    pin_memory: bool = True
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    ratio: float = Field(1.0, ge=0.0, le=1.0)
    super_offload: bool = False
    cpuadam_cores_perc: float = Field(0.8, ge=0.0, le=1.0)

    @field_validator("super_offload")
    @classmethod
    def _no_super_offload(cls, v: bool) -> bool:
        return _unsupported(v, False, "super_offload")


class OffloadParamConfig(Section):
    device: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: str | None = None
    buffer_count: int = Field(5, ge=1)
    buffer_size: int = Field(100_000_000, ge=1)
    max_in_cpu: int = Field(1_000_000_000, ge=0)
    pin_memory: bool = True


class ZeroConfig(Section):
    """``zero_optimization``; defaults follow DeepSpeed 0.19.8 except ``overlap_comm`` (docs/config.md)."""

    stage: Literal[0, 1, 2, 3] = 0
    overlap_comm: bool | None = None
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = Field(500_000_000, ge=1)
    allgather_partitions: bool = True
    allgather_bucket_size: int = Field(500_000_000, ge=1)
    use_multi_rank_bucket_allreduce: bool = True
    load_from_fp32_weights: bool = True
    elastic_checkpoint: bool = False
    ignore_unused_parameters: bool = True
    round_robin_gradients: bool = False
    sub_group_size: int = Field(1_000_000_000, ge=1)
    cpu_offload: bool | None = Field(None, description="deprecated: use offload_optimizer.device")
    offload_optimizer: OffloadOptimizerConfig | None = None
    offload_param: OffloadParamConfig | None = None
    stage3_max_live_parameters: int = Field(1_000_000_000, ge=0)
    stage3_max_reuse_distance: int = Field(1_000_000_000, ge=0)
    stage3_prefetch_bucket_size: int = Field(50_000_000, ge=0)
    stage3_param_persistence_threshold: int = Field(100_000, ge=0)
    stage3_model_persistence_threshold: int = Field(sys.maxsize, ge=0)
    stage3_gather_16bit_weights_on_model_save: bool = Field(
        False,
        validation_alias=AliasChoices(
            "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"
        ),
    )
    stage3_unit_modules: list[str] | None = None
    stage3_module_granularity_threshold: int = Field(0, ge=0)
    use_all_reduce_for_fetch_params: bool = Field(
        False, validation_alias=AliasChoices("use_all_reduce_for_fetch_params", "stage3_use_all_reduce_for_fetch_params")
    )
    allgather_sequential: bool = Field(False, validation_alias=AliasChoices("allgather_sequential", "stage3_allgather_sequential"))
    parameter_alignment: bool = False
    compute_grad_norm: bool = True
    zenflow: dict[str, Any] | None = None
    memory_efficient_linear: bool = True
    override_module_apply: bool = True
    log_trace_cache_warnings: bool = False
    pipeline_loading_checkpoint: bool = False
    legacy_stage1: bool = False
    zero_hpz_partition_size: int = 1
    zero_quantized_weights: bool = False
    zero_quantized_nontrainable_weights: bool = False
    zero_quantized_gradients: bool = False
    mics_shard_size: int = -1
    mics_hierarchical_params_gather: bool = False

    @field_validator("zero_hpz_partition_size")
    @classmethod
    def _no_hpz(cls, v: int) -> int:
        return _unsupported(v, 1, "ZeRO++ hierarchical partitioning")

    @field_validator("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients")
    @classmethod
    def _no_quantized(cls, v: bool) -> bool:
        return _unsupported(v, False, "ZeRO++ quantized communication")

    @field_validator("zenflow")
    @classmethod
    def _no_zenflow(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return _unsupported(v, None, "ZenFlow")

    @field_validator("mics_shard_size")
    @classmethod
    def _no_mics(cls, v: int) -> int:
        return _unsupported(v, -1, "MiCS sharding")

    @field_validator("legacy_stage1")
    @classmethod
    def _no_legacy(cls, v: bool) -> bool:
        return _unsupported(v, False, "legacy_stage1")

    @model_validator(mode="after")
    def _resolve_deprecated_cpu_offload(self) -> ZeroConfig:
        if self.cpu_offload and self.offload_optimizer is None:
            logger.warning("zero_optimization.cpu_offload is deprecated; treating it as offload_optimizer.device='cpu'")
            self.offload_optimizer = OffloadOptimizerConfig(device="cpu")
        return self

    @property
    def overlap(self) -> bool:
        """Overlap never changes results here, so it is on unless the user turns it off."""
        return True if self.overlap_comm is None else self.overlap_comm


class ActivationCheckpointingConfig(Section):
    """``activation_checkpointing``; ``module_classes`` (slipstream's) applies it to an unchanged model."""

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = Field(None, ge=1)
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False
    module_classes: list[str] | None = None
    use_reentrant: bool = False

    @field_validator("partition_activations")
    @classmethod
    def _no_partitioning(cls, v: bool) -> bool:
        return _unsupported(v, False, "partitioning activations across tensor-parallel ranks (slipstream has no tensor parallelism yet)")

    @field_validator("contiguous_memory_optimization")
    @classmethod
    def _no_contiguous(cls, v: bool) -> bool:
        return _unsupported(v, False, "contiguous_memory_optimization (it packs partitioned activations; see partition_activations)")

    @field_validator("profile")
    @classmethod
    def _no_profile(cls, v: bool) -> bool:
        return _unsupported(v, False, "activation_checkpointing.profile (use wall_clock_breakdown: recomputation shows in the backward time)")


class AioConfig(Section):
    block_size: int = Field(1_048_576, ge=4096)
    queue_depth: int = Field(8, ge=1)
    intra_op_parallelism: int = Field(1, ge=1, validation_alias=AliasChoices("intra_op_parallelism", "thread_count"))
    single_submit: bool = False
    overlap_events: bool = True
    use_gds: bool = False


class TensorBoardConfig(Section):
    enabled: bool = False
    output_path: str = ""
    job_name: str = "SlipstreamJobName"


class CSVMonitorConfig(Section):
    enabled: bool = False
    output_path: str = ""
    job_name: str = "SlipstreamJobName"


class WandbConfig(Section):
    enabled: bool = False
    group: str | None = None
    team: str | None = None
    project: str = "slipstream"


class FlopsProfilerConfig(Section):
    """``flops_profiler``: a measured FLOP profile of one step; ``peak_tflops`` (slipstream's) for MFU."""

    enabled: bool = False
    profile_step: int = Field(1, ge=1)
    module_depth: int = Field(-1, ge=-1)
    top_modules: int = Field(1, ge=1)
    detailed: bool = True
    output_file: str | None = None
    recompute_fwd_factor: float = Field(0.0, ge=0.0, le=1.0)
    peak_tflops: float | None = Field(None, gt=0.0, description="per-device peak TFLOP/s that MFU is relative to")


class CommsLoggerConfig(Section):
    enabled: bool = False
    verbose: bool = False
    prof_all: bool = True
    prof_ops: list[str] = Field(default_factory=list)
    debug: bool = False


class CheckpointParallelWriteConfig(Section):
    pipeline_stage: bool = Field(False, description="DeepSpeed key; accepted, no effect (no pipeline parallelism)")


class CheckpointConfig(Section):
    """``checkpoint``: slipstream's save/resume settings plus DeepSpeed's keys (see docs/checkpoints.md)."""

    save_dir: str | None = Field(None, description="where interval saves go and auto_resume looks")
    interval: int = Field(0, ge=0, description="save every N optimizer steps into save_dir; 0: never")
    auto_resume: bool = Field(False, description="initialize() loads the newest complete checkpoint in save_dir")
    async_save: bool = Field(False, validation_alias=AliasChoices("async", "async_save"), description="persist in the background")
    keep_last_n: int = Field(0, ge=0, description="keep the newest N checkpoints in a save directory; 0 keeps all")
    verify_checksums: bool = Field(True, description="check every file's CRC-32 when loading")
    commit_timeout: float = Field(600.0, gt=0.0, description="seconds rank 0 waits for the other ranks' files")
    tag_validation: Literal["Ignore", "Warn", "Fail"] = "Warn"
    load_universal: bool = Field(False, description="DeepSpeed key; every slipstream checkpoint is universal")
    use_node_local_storage: bool = Field(False, description="DeepSpeed key; not supported (save_dir must be shared)")
    parallel_write: CheckpointParallelWriteConfig = Field(default_factory=CheckpointParallelWriteConfig)
    writer: dict[str, Any] | None = Field(None, description="DeepSpeed FastPersist writer; accepted, no effect")

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _mode_case(cls, v: Any) -> Any:
        return v.capitalize() if isinstance(v, str) else v

    @field_validator("use_node_local_storage")
    @classmethod
    def _shared_only(cls, v: bool) -> bool:
        return _unsupported(v, False, "use_node_local_storage (each rank writing to its own disk)")

    @model_validator(mode="after")
    def _dir_for_auto(self) -> CheckpointConfig:
        if (self.auto_resume or self.interval) and not self.save_dir:
            raise ValueError("save_dir must be set when auto_resume or interval is used")
        return self


# DeepSpeed sections we accept so existing configs load, but which have no effect here.
IGNORED_SECTIONS = (
    "autotuning", "elasticity", "compression_training", "data_efficiency",
    "curriculum_learning", "progressive_layer_drop", "eigenvalue", "quantize_training", "nebula",
    "hybrid_engine", "weight_quantization", "compile", "timers", "data_types",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "memory_breakdown", "dump_state",
    "sparse_gradients", "seq_parallel_communication_data_type", "graph_harvesting",
    "use_data_before_expert_parallelism", "disable_allgather", "pipeline",
)  # fmt: skip


def _batch_value(value: Any) -> int | str | None:
    if value is None or value == AUTO:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 1:
        raise ValueError('must be a positive integer or "auto"')
    return int(value)


BatchValue = Annotated[int | str | None, BeforeValidator(_batch_value)]


class SlipstreamConfig(Section):
    """The whole configuration. Build it with :meth:`load`, which also resolves the batch triad."""

    train_batch_size: BatchValue = None
    train_micro_batch_size_per_gpu: BatchValue = None
    gradient_accumulation_steps: BatchValue = None
    steps_per_print: int | None = Field(None, ge=0, description="None or 0: no periodic progress line")
    wall_clock_breakdown: bool = False
    gradient_clipping: float = Field(1.0, ge=0.0, description="0 disables clipping")
    prescale_gradients: bool = False
    gradient_predivide_factor: float = Field(1.0, gt=0.0)
    gradient_allreduce_op: Literal["mean", "sum"] = "mean"
    log_level: Literal["debug", "info", "warning", "error", "critical"] | None = None
    torch_autocast: TorchAutocastConfig = Field(default_factory=TorchAutocastConfig)
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = None
    dataloader_drop_last: bool = False
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config, validation_alias=AliasChoices("bf16", "bfloat16"))
    amp: dict[str, Any] | None = None
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    activation_checkpointing: ActivationCheckpointingConfig = Field(default_factory=ActivationCheckpointingConfig)
    aio: AioConfig = Field(default_factory=AioConfig)
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    csv_monitor: CSVMonitorConfig = Field(default_factory=CSVMonitorConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    comms_timeout_seconds: float = Field(1800.0, gt=0.0, description="a collective waiting longer is an error")
    ignored: dict[str, Any] = Field(default_factory=dict, exclude=True)

    @field_validator("amp")
    @classmethod
    def _no_amp(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v and v.get("enabled", False):
            raise ValueError("NVIDIA apex AMP is not supported; use \"bf16\": {\"enabled\": true} or \"fp16\"")
        return v

    @model_validator(mode="after")
    def _one_precision(self) -> SlipstreamConfig:
        if self.fp16.enabled and self.bf16.enabled:
            raise ValueError("fp16.enabled and bf16.enabled are both true; choose one")
        return self

    # ------------------------------------------------------------------ derived values
    @property
    def precision(self) -> Literal["fp32", "fp16", "bf16"]:
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"

    @classmethod
    def load(
        cls, source: dict[str, Any] | str | os.PathLike[str] | SlipstreamConfig, world_size: int | None = 1
    ) -> SlipstreamConfig:
        """Parse ``source`` (dict, .json/.hjson path or config); resolve the batch triad unless ``world_size`` is None."""
        if isinstance(source, SlipstreamConfig):
            raw = source.model_dump(exclude_unset=True, by_alias=False)
            raw.update(source.ignored)
        else:
            raw = read_config_source(source)
        raw = _resolve_auto(dict(raw))
        ignored = {k: raw.pop(k) for k in list(raw) if k in IGNORED_SECTIONS}
        for key in ignored:
            logger.warning("config key %r is accepted for DeepSpeed compatibility but has no effect in slipstream", key)
        try:
            config = cls.model_validate(raw)
        except ValidationError as err:
            raise ConfigError(format_validation_error(err, cls)) from None
        config.ignored = ignored
        if world_size is not None:
            config.resolve_batch_triad(world_size)
        return config

    def resolve_batch_triad(self, world_size: int) -> None:
        """``train_batch_size = micro × accumulation × world size``; derive the missing one and log it."""
        tb, mb, gas = (
            None if v == AUTO else v
            for v in (self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps)
        )
        given = f"(train_batch_size={tb}, train_micro_batch_size_per_gpu={mb}, gradient_accumulation_steps={gas}, world size {world_size})"
        if tb is not None and tb % world_size:
            raise ConfigError(f"train_batch_size: {tb} is not divisible by the data-parallel world size {world_size}; use a multiple of {world_size}")
        if tb is not None and mb is not None and gas is not None:
            if tb != mb * gas * world_size:
                raise ConfigError(
                    f"train_batch_size: must equal train_micro_batch_size_per_gpu × gradient_accumulation_steps × world size "
                    f"= {mb} × {gas} × {world_size} = {mb * gas * world_size}, got {tb}; fix one of the three or omit one"
                )
        elif tb is not None and mb is not None:
            if tb % (mb * world_size):
                raise ConfigError(f"train_batch_size: {tb} is not divisible by train_micro_batch_size_per_gpu × world size = {mb * world_size} {given}")
            gas = tb // (mb * world_size)
        elif tb is not None and gas is not None:
            if tb % (gas * world_size):
                raise ConfigError(f"train_batch_size: {tb} is not divisible by gradient_accumulation_steps × world size = {gas * world_size} {given}")
            mb = tb // (gas * world_size)
        elif mb is not None:
            gas = gas or 1
            tb = mb * gas * world_size
        elif tb is not None:
            gas, mb = 1, tb // world_size
        else:
            raise ConfigError("train_batch_size: set train_batch_size or train_micro_batch_size_per_gpu (neither is given)")
        derived = {
            name: value
            for name, value in (("train_batch_size", tb), ("train_micro_batch_size_per_gpu", mb), ("gradient_accumulation_steps", gas))
            if getattr(self, name) in (None, AUTO)
        }
        if derived:
            logger.info("batch size: derived %s from %s", ", ".join(f"{k}={v}" for k, v in derived.items()), given)
        self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps = tb, mb, gas


# --------------------------------------------------------------------------- reading


def read_config_source(source: dict[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    """Return the raw config dict from a dict or a ``.json``/``.hjson`` file (comments allowed)."""
    if isinstance(source, dict):
        return json.loads(json.dumps(source))  # deep copy; also rejects values JSON cannot hold
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"config: file {str(path)!r} does not exist")
    try:
        data = hjson.loads(path.read_text())
    except hjson.HjsonDecodeError as err:
        raise ConfigError(f"config: {path} is not valid JSON/HJSON: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config: {path} must hold an object at the top level, got {type(data).__name__}")
    return json.loads(json.dumps(data))  # hjson returns OrderedDicts


# Paths where "auto" (as written for the HF Trainer) has a sensible resolution without a trainer.
# USE_DEFAULT drops the key, so the default applies exactly as if it were not written.
USE_DEFAULT = object()
_AUTO_DEFAULTS: dict[tuple[str, ...], Any] = {
    ("gradient_clipping",): 1.0,
    ("fp16", "enabled"): False,
    ("bf16", "enabled"): False,
    ("bfloat16", "enabled"): False,
    ("zero_optimization", "reduce_bucket_size"): USE_DEFAULT,
    ("zero_optimization", "allgather_bucket_size"): USE_DEFAULT,
    ("zero_optimization", "stage3_prefetch_bucket_size"): USE_DEFAULT,
    ("zero_optimization", "stage3_param_persistence_threshold"): USE_DEFAULT,
}


def _resolve_auto(raw: dict[str, Any]) -> dict[str, Any]:
    for path, value in _AUTO_DEFAULTS.items():
        node: Any = raw
        for key in path[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(path[-1]) == AUTO:
            if value is USE_DEFAULT:
                del node[path[-1]]
                logger.info("config: %s is \"auto\"; using the default", ".".join(path))
            else:
                node[path[-1]] = value
                logger.info("config: %s is \"auto\"; resolved to %r", ".".join(path), value)
    return raw


# --------------------------------------------------------------------------- errors


def _section_model(model: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model that holds the key at ``loc`` (for did-you-mean suggestions)."""
    for key in loc:
        field = next(
            (f for name, f in model.model_fields.items() if key == name or key in _aliases(f)),
            None,
        )
        if field is None:
            return None
        candidates = [field.annotation, *get_args(field.annotation)]
        nested = [c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)]
        if not nested:
            return None
        model = nested[0]
    return model


def _aliases(field: Any) -> list[str]:
    alias = field.validation_alias
    if isinstance(alias, AliasChoices):
        return [a for a in alias.choices if isinstance(a, str)]
    return [alias] if isinstance(alias, str) else []


def known_keys(model: type[BaseModel]) -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        if field.exclude:
            continue
        keys.append(name)
        keys.extend(a for a in _aliases(field) if a != name)
    return keys


def did_you_mean(key: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(key, choices, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(sorted(choices))}"


def _describe_expected(err: dict[str, Any]) -> str:
    kind, ctx = err["type"], err.get("ctx", {})
    if kind == "literal_error":
        return f"must be {ctx.get('expected', '')}"
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        op = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}[kind]
        bound = next(iter(ctx.values()))
        return f"must be {op} {bound}"
    if kind.startswith(("int_", "float_", "bool_", "string_", "dict_", "list_", "tuple_", "model_")):
        expected = {
            "int": "an integer", "float": "a number", "bool": "true or false", "string": "a string",
            "dict": "an object", "list": "a list", "tuple": "a list", "model": "an object",
        }.get(kind.split("_")[0], "")  # fmt: skip
        return f"must be {expected}" if expected else err["msg"]
    msg = err["msg"]
    return msg.removeprefix("Value error, ")


def format_validation_error(err: ValidationError, model: type[BaseModel], prefix: str = "") -> str:
    """One line per problem: ``key.path: what is wrong, got <value>``."""
    lines: list[str] = []
    seen: set[str] = set()
    for e in err.errors():
        loc = tuple(e["loc"])
        path = ".".join(str(p) for p in (prefix.split(".") if prefix else []) + list(loc)) or "config"
        if e["type"] == "extra_forbidden":
            parent = _section_model(model, loc[:-1])
            hint = did_you_mean(str(loc[-1]), known_keys(parent)) if parent else ""
            if prefix == "" and len(loc) == 1:
                hint = did_you_mean(str(loc[-1]), known_keys(model) + list(IGNORED_SECTIONS))
            line = f"{path}: unknown key{hint}"
        elif e["type"] == "missing":
            line = f"{path}: is required"
        elif e["type"] == "value_error" and not loc:
            line = f"config: {_describe_expected(e)}"
        elif e.get("input") == AUTO:
            line = f"{path}: \"auto\" cannot be resolved here (there is no trainer to fill it in); set a value"
        else:
            line = f"{path}: {_describe_expected(e)}, got {_show(e.get('input'))}"
        if path not in seen:
            seen.add(path)
            lines.append(line)
    return "\n".join(lines)


def _show(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (dict, list, str, int, float, bool, type(None))) else repr(value)
    return text if len(text) < 80 else text[:77] + "..."

