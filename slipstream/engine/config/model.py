"""``SlipstreamConfig``: the whole configuration, its loading, and the batch-size triad."""

from __future__ import annotations

import logging
import math
import os
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BeforeValidator, Field, ValidationError, field_validator, model_validator

from slipstream.engine.config import parallel, sections
from slipstream.engine.config.base import AUTO, ConfigError, Section
from slipstream.engine.config.compat import IGNORED_SECTIONS, split_unknown_top_level, warn_no_effect
from slipstream.engine.config.errors import format_validation_error, known_keys
from slipstream.engine.config.source import read_config_source, resolve_auto
from slipstream.engine.config.zero import ZeroConfig
from slipstream.utils.logging import get_logger, log_rank0

logger = get_logger(__name__)
_warned_sections: set[str] = set()  # ignored top-level sections already warned about in this process

# A timeout this long is "forever" for any job, and still fits torch's millisecond timedelta.
MAX_TIMEOUT_S = 1e9


def _batch_value(value: Any) -> int | str | None:
    if value is None or value == AUTO:
        return value
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value != int(value)
        or value < 1
    ):
        raise ValueError('must be a positive integer or "auto"')
    return int(value)


def _steps_per_print(value: Any) -> Any:
    """DeepSpeed takes a float here, and Accelerate writes ``inf`` to mean "never": that is None."""
    if isinstance(value, float) and value == math.inf:
        return None
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        return int(value)
    return value


BatchValue = Annotated[int | str | None, BeforeValidator(_batch_value)]


class SlipstreamConfig(Section):
    """The whole configuration. Build it with :meth:`load`, which also resolves the batch triad."""

    train_batch_size: BatchValue = None
    train_micro_batch_size_per_gpu: BatchValue = None
    gradient_accumulation_steps: BatchValue = None
    steps_per_print: Annotated[int | None, BeforeValidator(_steps_per_print)] = Field(
        None, ge=0, description="None, 0 or infinity: no periodic progress line"
    )
    wall_clock_breakdown: bool = False
    gradient_clipping: float = Field(1.0, ge=0.0, description="0 disables clipping")
    prescale_gradients: bool = False
    gradient_predivide_factor: float = Field(1.0, gt=0.0)
    gradient_allreduce_op: Literal["mean", "sum"] = "mean"
    log_level: Literal["debug", "info", "warning", "error", "critical"] | None = None
    torch_autocast: sections.TorchAutocastConfig = Field(default_factory=sections.TorchAutocastConfig)
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = None
    dataloader_drop_last: bool = False
    optimizer: sections.OptimizerConfig | None = None
    scheduler: sections.SchedulerConfig | None = None
    fp16: sections.FP16Config = Field(default_factory=sections.FP16Config)
    bf16: sections.BF16Config = Field(
        default_factory=sections.BF16Config, validation_alias=AliasChoices("bf16", "bfloat16")
    )
    amp: dict[str, Any] | None = None
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    activation_checkpointing: sections.ActivationCheckpointingConfig = Field(
        default_factory=sections.ActivationCheckpointingConfig
    )
    aio: sections.AioConfig = Field(default_factory=sections.AioConfig)
    tensorboard: sections.TensorBoardConfig = Field(default_factory=sections.TensorBoardConfig)
    csv_monitor: sections.CSVMonitorConfig = Field(default_factory=sections.CSVMonitorConfig)
    wandb: sections.WandbConfig = Field(default_factory=sections.WandbConfig)
    comms_logger: sections.CommsLoggerConfig = Field(default_factory=sections.CommsLoggerConfig)
    checkpoint: sections.CheckpointConfig = Field(default_factory=sections.CheckpointConfig)
    flops_profiler: sections.FlopsProfilerConfig = Field(default_factory=sections.FlopsProfilerConfig)
    comms_timeout_seconds: float = Field(
        1800.0, gt=0.0, le=MAX_TIMEOUT_S, description="a collective waiting longer is an error"
    )
    long_context: sections.LongContextConfig = Field(default_factory=sections.LongContextConfig)
    compile: sections.CompileConfig = Field(default_factory=sections.CompileConfig)
    twin_check: bool = Field(
        True, description="run the parallelized model next to its unparallelized twin at initialize (parallel/twin/)"
    )
    # The mesh (engine/parallel/mesh.py): world = pp · dp · cp · sp · tp.
    tensor_parallel: parallel.TensorParallelConfig = Field(default_factory=parallel.TensorParallelConfig)
    pipeline: parallel.PipelineConfig = Field(default_factory=parallel.PipelineConfig)
    sequence_parallel_size: int = Field(1, ge=1)
    context_parallel: parallel.ContextParallelConfig = Field(default_factory=parallel.ContextParallelConfig)
    expert_parallel: parallel.ExpertParallelConfig = Field(default_factory=parallel.ExpertParallelConfig)
    data_parallel_size: int | None = Field(None, ge=1, description="None: world size / (pp · cp · sp · tp)")
    ignored: dict[str, Any] = Field(default_factory=dict, exclude=True)

    @field_validator("amp")
    @classmethod
    def _no_amp(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v and v.get("enabled", False):
            raise ValueError('NVIDIA apex AMP is not supported; use "bf16": {"enabled": true} or "fp16"')
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
        raw = resolve_auto(dict(raw))
        if "bf16" in raw and "bfloat16" in raw:  # DeepSpeed reads bf16 first
            logger.warning("config: both 'bf16' and 'bfloat16' are given; using 'bf16' and ignoring 'bfloat16'")
            del raw["bfloat16"]
        ignored = {k: raw.pop(k) for k in list(raw) if k in IGNORED_SECTIONS}
        for key in ignored:
            if key not in _warned_sections:  # once per process, on rank 0: every rank reads the same file
                _warned_sections.add(key)
                log_rank0(
                    logger,
                    "config key %r is accepted for DeepSpeed compatibility but has no effect in slipstream",
                    key,
                    level=logging.WARNING,
                )
        ignored.update(split_unknown_top_level(raw, known_keys(cls)))
        try:
            config = cls.model_validate(raw)
        except ValidationError as err:
            raise ConfigError(format_validation_error(err, cls, top_level=IGNORED_SECTIONS)) from None
        config.ignored = ignored
        warn_no_effect(config)
        if world_size is not None:
            config.resolve_batch_triad(world_size)
        return config

    def resolve_batch_triad(self, world_size: int) -> None:
        """``train_batch_size = micro × accumulation × dp``; derive the missing one and log it.

        ``dp`` is the data-parallel size of the mesh (``world_size`` when every other axis is 1):
        ranks that differ only in pp, cp, sp or tp coordinates work on the same micro-batch.
        """
        dp = parallel.mesh_sizes(self, world_size).dp
        size = "world size" if dp == world_size else f"data-parallel size (dp of world {world_size})"
        raw = (self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps)
        tb, mb, gas = (None if v == AUTO else v for v in raw)
        given = f"(train_batch_size={tb}, train_micro_batch_size_per_gpu={mb}, gradient_accumulation_steps={gas}, {size} {dp})"
        if tb is not None and tb % dp:
            raise ConfigError(
                f"train_batch_size: {tb} is not divisible by the data-parallel world size {dp}; use a multiple of {dp}"
            )
        if tb is not None and mb is not None and gas is not None:
            if tb != mb * gas * dp:
                raise ConfigError(
                    f"train_batch_size: must equal train_micro_batch_size_per_gpu × gradient_accumulation_steps × {size} "
                    f"= {mb} × {gas} × {dp} = {mb * gas * dp}, got {tb}; fix one of the three or omit one"
                )
        elif tb is not None and mb is not None:
            if tb % (mb * dp):
                raise ConfigError(
                    f"train_batch_size: {tb} is not divisible by train_micro_batch_size_per_gpu × {size} = {mb * dp} {given}"
                )
            gas = tb // (mb * dp)
        elif tb is not None and gas is not None:
            if tb % (gas * dp):
                raise ConfigError(
                    f"train_batch_size: {tb} is not divisible by gradient_accumulation_steps × {size} = {gas * dp} {given}"
                )
            mb = tb // (gas * dp)
        elif mb is not None:
            gas = gas or 1
            tb = mb * gas * dp
        elif tb is not None:
            gas, mb = 1, tb // dp
        elif AUTO in raw:
            autos = ", ".join(
                n
                for n, v in zip(
                    ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"), raw
                )
                if v == AUTO
            )
            raise ConfigError(
                f'train_batch_size: {autos} {"is" if "," not in autos else "are"} "auto", which a trainer fills in (the Hugging Face Trainer, Accelerate), '
                "and there is none here; set train_micro_batch_size_per_gpu (or train_batch_size) to a number, "
                "or use slipstream.integrations"
            )
        else:
            raise ConfigError(
                "train_batch_size: set train_batch_size or train_micro_batch_size_per_gpu (neither is given)"
            )
        derived = {
            name: value
            for name, value in (
                ("train_batch_size", tb),
                ("train_micro_batch_size_per_gpu", mb),
                ("gradient_accumulation_steps", gas),
            )
            if getattr(self, name) in (None, AUTO)
        }
        if derived:
            logger.info("batch size: derived %s from %s", ", ".join(f"{k}={v}" for k, v in derived.items()), given)
        self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps = tb, mb, gas


def load_config(
    source: dict[str, Any] | str | os.PathLike[str] | SlipstreamConfig, world_size: int | None = None
) -> SlipstreamConfig:
    """Parse and validate a config without building an engine (what ``initialize`` does first).

    With ``world_size`` the batch triad and the mesh are resolved as they would be on that many
    ranks; without it, ``"auto"`` and missing batch sizes stay as written.
    """
    return SlipstreamConfig.load(source, world_size=world_size)
