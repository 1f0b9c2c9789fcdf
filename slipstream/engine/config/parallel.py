"""The mesh keys (tensor, pipeline, sequence, context, expert, data parallel) and the sizes they give.

[Note: one factoring] ``world = pp · dp · cp · sp · tp``; ``dp`` is derived from the others unless
``data_parallel_size`` says it, and ``ep`` borrows ranks from ``dp · cp · sp · tp`` (within one
pipeline stage). The batch triad and the mesh both read :func:`mesh_sizes`, so they can never
disagree about ``dp``. Pure arithmetic: no process group is needed, so ``load_config(path,
world_size=8)`` checks a file on a laptop.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import Field, field_validator

from slipstream.engine.config.base import AUTO, ConfigError, Section

AXES = ("pp", "dp", "cp", "sp", "tp")  # rank order, outer to inner (tp innermost)
ALL_AXES = (*AXES, "ep")
# The key that sets each axis, for messages.
AXIS_KEYS = {
    "pp": "pipeline.stages",
    "dp": "data_parallel_size",
    "cp": "context_parallel.size",
    "sp": "sequence_parallel_size",
    "tp": "tensor_parallel.autotp_size",
    "ep": "expert_parallel.autoep_size",
}


class TensorParallelConfig(Section):
    """``tensor_parallel``: DeepSpeed's AutoTP training section (``autotp_size`` 0 or 1: off)."""

    autotp_size: int = Field(0, ge=0)
    partition_config: dict[str, Any] | None = None
    sequence_parallel: bool = False
    tp_overlap_comm: bool = False
    preset_model: str | None = None
    keep_module_on_host: bool = False
    replace_with_kernel_inject: bool = Field(False, alias="kernel_inject")
    dtype: str | None = None
    tp: dict[str, Any] | None = None
    injection_policy_tuple: list[Any] | None = None


class PipelineConfig(Section):
    """``pipeline``: DeepSpeed's keys (``stages``, ``partition``, ...) plus the schedule to run."""

    stages: int | None = Field(None, ge=1, description='None or "auto": 1 (no pipeline)')
    schedule: Literal["afab", "gpipe", "1f1b", "interleaved_1f1b", "zb1p", "zbv", "dualpipev"] = "1f1b"
    virtual_stages: int = Field(1, ge=1)
    partition: str = "parameters"  # uniform | parameters | type:<regex> (DeepSpeed's partition_method)
    seed_layers: bool = False
    activation_checkpoint_interval: int = Field(0, ge=0)
    pipe_partitioned: bool = True
    grad_partitioned: bool = True

    @field_validator("stages", mode="before")
    @classmethod
    def _auto_stages(cls, v: Any) -> Any:
        return None if v == AUTO else v


class ContextParallelConfig(Section):
    """``context_parallel`` (slipstream's): the sequence split across ranks inside attention."""

    size: int = Field(1, ge=1)
    # zigzag = zigzag_ring: head-tail chunks balance causal work; allgather_kv: K/V all-gathered, no ring
    method: Literal["ring", "zigzag", "zigzag_ring", "allgather_kv"] = "ring"


class ExpertParallelConfig(Section):
    """``expert_parallel``: DeepSpeed's AutoEP section; ``autoep_size`` counts only when ``enabled``."""

    enabled: bool = False
    autoep_size: int = Field(1, ge=1)
    preset_model: str | None = None
    moe_layer_pattern: str | None = None
    expert_pattern: str | None = None
    router_pattern: str | None = None
    use_grouped_mm: bool = True
    grouped_mm_backend: Literal["auto", "torch", "cutlass", "sequential"] = "auto"
    route_norm: bool | None = None
    route_scale: float = 1.0
    score_apply: Literal["auto", "pre", "post"] = "auto"
    score_func: Literal["auto", "softmax", "sigmoid"] = "auto"
    num_expert_groups: int | None = Field(None, ge=1)
    num_limited_groups: int | None = Field(None, ge=1)
    top_k: int | Literal["auto"] = AUTO
    load_balance_coeff: float | None = 1e-3
    routed_scaling_factor: float | Literal["auto"] = AUTO
    expert_w1: str | None = None
    expert_w2: str | None = None
    expert_w3: str | None = None
    num_experts_attr: str | None = None
    top_k_attr: str | None = None
    has_shared_experts: bool | None = None
    shared_experts_pattern: str | None = None
    drop_tokens: bool = False  # accepted for compatibility: always dropless
    capacity_factor: float | None = Field(None, gt=0)


@dataclasses.dataclass(frozen=True)
class MeshSizes:
    """How many ranks each axis spans; ``world = pp · dp · cp · sp · tp``, ``ep`` divides ``world / pp``."""

    pp: int = 1
    dp: int = 1
    cp: int = 1
    sp: int = 1
    tp: int = 1
    ep: int = 1

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.sp * self.tp

    def size(self, axis: str) -> int:
        if axis not in ALL_AXES:
            raise ValueError(f"mesh: unknown axis {axis!r}; the axes are {', '.join(ALL_AXES)}")
        return int(getattr(self, axis))

    def describe(self) -> str:
        text = " × ".join(f"{axis} {self.size(axis)}" for axis in AXES)
        return f"world {self.world} = {text}" + (f" (ep {self.ep})" if self.ep > 1 else "")


def requested_sizes(config: Any) -> dict[str, int | None]:
    """The size the config asks of each axis (``dp`` None: derive it from the world size)."""
    return {
        "pp": config.pipeline.stages or 1,
        "dp": config.data_parallel_size,
        "cp": config.context_parallel.size,
        "sp": config.sequence_parallel_size,
        "tp": max(1, config.tensor_parallel.autotp_size),
        "ep": config.expert_parallel.autoep_size if config.expert_parallel.enabled else 1,
    }


def mesh_sizes(config: Any, world_size: int) -> MeshSizes:
    """Factor ``world_size`` as the config asks, or raise a one-line :class:`ConfigError` naming the keys."""
    asked = requested_sizes(config)
    model = asked["pp"] * asked["cp"] * asked["sp"] * asked["tp"]  # type: ignore[operator]
    product = " × ".join(f"{AXIS_KEYS[a]} {asked[a] if a != 'dp' else 'dp'}" for a in AXES)
    if world_size % model:
        raise ConfigError(
            f"mesh: world size {world_size} does not factor as {product} (= {model} × dp); "
            f"choose sizes whose product ({model}) divides {world_size}"
        )
    dp = world_size // model
    if asked["dp"] is not None and asked["dp"] != dp:
        raise ConfigError(
            f"data_parallel_size: {asked['dp']} does not fit world size {world_size} = {product} gives dp {dp}; "
            f"set it to {dp} or remove it"
        )
    sizes = MeshSizes(pp=asked["pp"], dp=dp, cp=asked["cp"], sp=asked["sp"], tp=asked["tp"], ep=asked["ep"])  # type: ignore[arg-type]
    span = world_size // sizes.pp
    if span % sizes.ep:
        raise ConfigError(
            f"expert_parallel.autoep_size: {sizes.ep} must divide dp × cp × sp × tp = {sizes.dp} × {sizes.cp} × "
            f"{sizes.sp} × {sizes.tp} = {span} (the ranks of one pipeline stage); choose a divisor of {span}"
        )
    return sizes
