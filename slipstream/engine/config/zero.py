"""``zero_optimization`` and its offload subsections (defaults follow DeepSpeed 0.19.8)."""

from __future__ import annotations

import sys
from typing import Any, Literal

from pydantic import AliasChoices, Field, model_validator

from slipstream.engine.config.base import Section, refuse
from slipstream.utils.logging import get_logger

logger = get_logger(__name__)


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

    _no_super_offload = refuse("super_offload", allowed=False, what="super_offload")


class OffloadParamConfig(Section):
    device: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: str | None = None
    buffer_count: int = Field(5, ge=1)
    buffer_size: int = Field(100_000_000, ge=1)
    max_in_cpu: int = Field(1_000_000_000, ge=0)
    pin_memory: bool = True


def _stage3(name: str, *more: str) -> AliasChoices:
    """DeepSpeed reads ``stage3_<name>`` and the unprefixed ``<name>`` as the same field."""
    return AliasChoices(f"stage3_{name}", name, *more)


# (field, its other spellings): written twice with different values is an error, not a coin toss.
STAGE3_ALIASES: dict[str, tuple[str, ...]] = {
    "stage3_max_live_parameters": ("max_live_parameters",),
    "stage3_max_reuse_distance": ("max_reuse_distance",),
    "stage3_prefetch_bucket_size": ("prefetch_bucket_size",),
    "stage3_param_persistence_threshold": ("param_persistence_threshold",),
    "stage3_model_persistence_threshold": ("model_persistence_threshold",),
    "stage3_gather_16bit_weights_on_model_save": (
        "gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save",
    ),
    "stage3_module_granularity_threshold": ("module_granularity_threshold",),
    "use_all_reduce_for_fetch_params": ("stage3_use_all_reduce_for_fetch_params",),
    "allgather_sequential": ("stage3_allgather_sequential",),
}


ZERO_MEANS_DEFAULT = ("sub_group_size", "reduce_bucket_size", "allgather_bucket_size")

# The gradient bucket, in elements, when reduce_bucket_size is not set: DeepSpeed's 5e8 would put a whole
# model in one bucket and leave nothing to overlap with backward (DDP uses 25 MB). The estimator sizes
# stage 2's send buffers by it too.
DEFAULT_REDUCE_BUCKET_NUMEL = 25 * 2**20 // 4


class ZeroConfig(Section):
    """``zero_optimization``; defaults follow DeepSpeed 0.19.8 except ``overlap_comm`` (docs/config.md)."""

    stage: Literal[0, 1, 2, 3] = 0
    overlap_comm: bool | None = None
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = Field(500_000_000, ge=0, description="0: the default, as if unset")
    allgather_partitions: bool = True
    allgather_bucket_size: int = Field(500_000_000, ge=0, description="0: the default, as if unset")
    use_multi_rank_bucket_allreduce: bool = True
    load_from_fp32_weights: bool = True
    elastic_checkpoint: bool = False
    ignore_unused_parameters: bool = True
    round_robin_gradients: bool = False
    sub_group_size: int = Field(1_000_000_000, ge=0, description="0: the default, as if unset")
    cpu_offload: bool | None = Field(None, description="deprecated: use offload_optimizer.device")
    offload_optimizer: OffloadOptimizerConfig | None = None
    offload_param: OffloadParamConfig | None = None
    stage3_max_live_parameters: int = Field(1_000_000_000, ge=0, validation_alias=_stage3("max_live_parameters"))
    stage3_max_reuse_distance: int | None = Field(
        None,
        ge=0,
        validation_alias=_stage3("max_reuse_distance"),
        description="None: only the last block stays gathered into the backward (stage3/schedule.py, [Note: kept from the forward into the backward])",
    )
    stage3_prefetch_bucket_size: int | None = Field(
        None,
        ge=0,
        validation_alias=_stage3("prefetch_bucket_size"),
        description="None: the next unit only (see stage3/schedule.py, [Note: how far to gather ahead])",
    )
    stage3_param_persistence_threshold: int = Field(
        100_000, ge=0, validation_alias=_stage3("param_persistence_threshold")
    )
    stage3_model_persistence_threshold: int = Field(
        sys.maxsize, ge=0, validation_alias=_stage3("model_persistence_threshold")
    )
    stage3_gather_16bit_weights_on_model_save: bool = Field(
        False,
        validation_alias=_stage3("gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"),
    )
    stage3_unit_modules: list[str] | None = None
    partition_single_rank: bool = Field(
        False,
        description="on one process (world size 1, nothing offloaded) every stage runs as the plain step, which holds "
        "the same memory; true keeps the stage's own partitioning there",
    )
    stage3_module_granularity_threshold: int = Field(0, ge=0, validation_alias=_stage3("module_granularity_threshold"))
    use_all_reduce_for_fetch_params: bool = Field(
        False,
        validation_alias=AliasChoices("use_all_reduce_for_fetch_params", "stage3_use_all_reduce_for_fetch_params"),
    )
    allgather_sequential: bool = Field(
        False, validation_alias=AliasChoices("allgather_sequential", "stage3_allgather_sequential")
    )
    parameter_alignment: bool = False
    compute_grad_norm: bool = True
    zenflow: dict[str, Any] | None = None
    memory_efficient_linear: bool = True
    override_module_apply: bool = True
    log_trace_cache_warnings: bool = False
    pipeline_loading_checkpoint: bool = False
    legacy_stage1: bool = False
    zero_hpz_partition_size: int = Field(
        1, ge=1, description="ZeRO++ hpZ: ranks of the secondary (intra-node) weight partition; 1: none"
    )
    zero_quantized_weights: bool = False
    zero_quantized_nontrainable_weights: bool = False
    zero_quantized_gradients: bool = False
    mics_shard_size: int = Field(
        -1, ge=-1, description="MiCS: shard within groups of this many ranks, replicate across them; -1: over all"
    )
    mics_hierarchical_params_gather: bool = False

    @model_validator(mode="before")
    @classmethod
    def _one_value_per_alias(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, others in STAGE3_ALIASES.items():
            given = {key: data[key] for key in (name, *others) if key in data}
            if len({repr(v) for v in given.values()}) > 1:
                spelled = " and ".join(f"{k}={v!r}" for k, v in given.items())
                raise ValueError(f"{spelled} are one setting with two values; keep one")
        return data

    _no_quantized = refuse(
        "zero_quantized_nontrainable_weights", allowed=False, what="ZeRO++ INT8 storage of frozen weights"
    )

    _no_zenflow = refuse("zenflow", allowed=None, what="ZenFlow")

    _no_legacy = refuse("legacy_stage1", allowed=False, what="legacy_stage1")

    @model_validator(mode="after")
    def _resolve_deprecated_and_zero(self) -> ZeroConfig:
        if self.cpu_offload and self.offload_optimizer is None:
            logger.warning("zero_optimization.cpu_offload is deprecated; treating it as offload_optimizer.device='cpu'")
            self.offload_optimizer = OffloadOptimizerConfig(device="cpu")
        self._check_hierarchy()
        for name in ZERO_MEANS_DEFAULT:  # DeepSpeed accepts 0 (transformers' test configs write it): "not set" here
            if getattr(self, name) == 0:
                self.__dict__[name] = ZeroConfig.model_fields[name].default
                self.model_fields_set.discard(name)
        return self

    def _check_hierarchy(self) -> None:
        """hpZ and MiCS are layouts of stage 3's weights, and one at a time (docs/zero.md, "Hierarchical layouts")."""
        layouts = (
            ("zero_hpz_partition_size", self.zero_hpz_partition_size, 1),
            ("mics_shard_size", self.mics_shard_size, -1),
            ("zero_quantized_weights", self.zero_quantized_weights, False),
            ("zero_quantized_gradients", self.zero_quantized_gradients, False),
        )
        for name, value, off in layouts:
            if value != off and self.stage != 3:
                raise ValueError(
                    f"zero_optimization.{name}: needs stage 3 (ZeRO++ and MiCS change how its partitions move), got stage {self.stage}"
                )
        if self.zero_hpz_partition_size > 1 and self.mics_shard_size > 0:
            raise ValueError(
                "zero_optimization.zero_hpz_partition_size: hpZ and MiCS (mics_shard_size) are two layouts of the same "
                "weights; set one (MiCS already keeps every gather inside its shard group)"
            )
        if self.mics_shard_size == 0:
            raise ValueError(
                "zero_optimization.mics_shard_size: 0 ranks per shard group; use -1 (off) or a divisor of the data-parallel size"
            )

    @property
    def overlap(self) -> bool:
        """Overlap never changes results here, so it is on unless the user turns it off."""
        return True if self.overlap_comm is None else self.overlap_comm
