"""The config sections other than ZeRO and the mesh: precision, optimizer, monitors, checkpoints."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, Field, field_validator, model_validator

from slipstream.engine.config.base import Section, refuse

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

    _no_fp16_masters = refuse("fp16_master_weights_and_grads", allowed=False, what="fp16 master weights")


class BF16Config(Section):
    enabled: bool = False
    auto_cast: bool = False  # slipstream's: cast floating-point forward inputs to bf16 (as fp16.auto_cast)
    immediate_grad_update: bool = False
    check_grad_overflow: bool = True
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False

    _fp32_masters_only = refuse(
        "bf16_master_weights_and_grads",
        "bf16_optimizer_states",
        allowed=False,
        what="bf16 master weights / optimizer states (slipstream keeps them in fp32)",
    )


class TorchAutocastConfig(Section):
    enabled: bool = False
    dtype: str | None = None
    lower_precision_safe_modules: list[str] | None = None

    _no_autocast = refuse("enabled", allowed=False, what="torch_autocast (use bf16 or fp16)")


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
    offload_path: str | None = Field(
        None, description="checkpointed inputs go to files in this directory (host memory the limit)"
    )

    _no_partitioning = refuse(
        "partition_activations",
        allowed=False,
        what="partitioning activations across tensor-parallel ranks (not implemented for slipstream's tensor parallelism; tensor_parallel.sequence_parallel shards the norm/dropout activations instead)",
    )

    _no_contiguous = refuse(
        "contiguous_memory_optimization",
        allowed=False,
        what="contiguous_memory_optimization (it packs partitioned activations; see partition_activations)",
    )

    _no_profile = refuse(
        "profile",
        allowed=False,
        what="activation_checkpointing.profile (use wall_clock_breakdown: recomputation shows in the backward time)",
    )


class TilingConfig(Section):
    """One of ``long_context``'s tilings: on or off, and how many tokens one tile holds."""

    enabled: bool = False
    tile_tokens: int = Field(
        2048, ge=1, description="tokens per tile (over the micro-batch's rows and positions together)"
    )


class TiledMLPConfig(TilingConfig):
    """``long_context.tiled_mlp``; ``module_classes`` names the MLP classes (default: found in each block)."""

    module_classes: list[str] | None = None


class LongContextConfig(Section):
    """``long_context`` (Slipstream's): what bounds the sequence once attention is sharded (parallel/tiling/)."""

    tiled_logits: TilingConfig = Field(default_factory=TilingConfig)
    tiled_mlp: TiledMLPConfig = Field(default_factory=TiledMLPConfig)


class CompileConfig(Section):
    """``compile``: ``torch.compile`` on each repeated block (parallel/compiling.py).

    ``enabled``/``backend``/``kwargs`` are DeepSpeed's older keys (newer DeepSpeed takes them in
    ``engine.compile(backend=..., compile_kwargs=...)``, which slipstream's engine has too);
    ``deepcompile`` turns compiling on as well. DeepCompile's own passes are not slipstream's: its
    knobs parse and are listed as having no effect (config/compat.py).
    """

    enabled: bool = False
    backend: str = "inductor"
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="passed to torch.compile: fullgraph, dynamic, mode, options"
    )
    module_classes: list[str] | None = Field(None, description="the classes to compile (default: the repeated blocks)")
    loss: bool = Field(True, description="compile the model's loss_function too (fused cross entropy: less memory)")
    compiled_autograd: bool = Field(
        False, description="run each backward under compiled autograd, with the same backend and kwargs"
    )
    deepcompile: bool = False
    free_activation: bool = False
    free_activation_threshold: int = 10 * 1024 * 1024
    offload_activation: bool = False
    offload_opt_states: bool = False
    offload_parameters: bool = False
    double_buffer: bool = True
    symmetric_memory: bool = False
    dump_graphs: bool = False
    debug_log: bool = False
    sync_before_reduce: bool = False
    sync_after_reduce: bool = False
    sync_before_allgather: bool = False
    sync_after_allgather: bool = False
    keep_int_input_tensors: bool = True
    keep_all_input_tensors: bool = False

    @property
    def on(self) -> bool:
        return self.enabled or self.deepcompile

    @field_validator("kwargs")
    @classmethod
    def _known_kwargs(cls, value: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(value) - {"fullgraph", "dynamic", "mode", "options"})
        if unknown:
            raise ValueError(f"{', '.join(unknown)}: not a torch.compile argument (fullgraph, dynamic, mode, options)")
        return value


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
    async_save: bool = Field(
        False, validation_alias=AliasChoices("async", "async_save"), description="persist in the background"
    )
    keep_last_n: int = Field(0, ge=0, description="keep the newest N checkpoints in a save directory; 0 keeps all")
    in_memory_interval: int = Field(
        0,
        ge=0,
        description="snapshot every N optimizer steps into this node's shared memory; auto_resume restores the newer of it and save_dir",
    )
    in_memory_dir: str | None = Field(
        None, description="where in-memory snapshots go; default: the launcher's per-run directory on /dev/shm"
    )
    verify_checksums: bool = Field(True, description="check every file's CRC-32 when loading")
    commit_timeout: float = Field(600.0, gt=0.0, description="seconds rank 0 waits for the other ranks' files")
    tag_validation: Literal["Ignore", "Warn", "Fail"] = "Warn"
    load_universal: bool = Field(False, description="DeepSpeed key; every slipstream checkpoint is universal")
    use_node_local_storage: bool = Field(
        False, description="DeepSpeed key; accepted, no effect (save_dir must be shared)"
    )
    parallel_write: CheckpointParallelWriteConfig = Field(default_factory=CheckpointParallelWriteConfig)
    writer: dict[str, Any] | None = Field(None, description="DeepSpeed FastPersist writer; accepted, no effect")

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _mode_case(cls, v: Any) -> Any:
        return v.capitalize() if isinstance(v, str) else v

    @model_validator(mode="after")
    def _dir_for_auto(self) -> CheckpointConfig:
        if (self.auto_resume or self.interval) and not self.save_dir:
            raise ValueError("save_dir must be set when auto_resume or interval is used")
        if self.in_memory_interval and not self.auto_resume:
            raise ValueError(
                "in_memory_interval needs auto_resume: true (snapshots exist to be restored after a restart)"
            )
        return self
