"""DeepSpeed compatibility: what is accepted so existing configs load, and said aloud when it does nothing.

[Note: no silent no-ops] Every key the schema accepts is either read by the engine, refused when
set to something slipstream cannot do (the ``unsupported`` validators), or listed in
:data:`NO_EFFECT` below: the one table of keys that parse but change nothing. Setting one of those
to a value other than its default logs one warning naming it (once per process), so nobody tunes
a knob that is not connected. Whole DeepSpeed sections with no counterpart are in
:data:`IGNORED_SECTIONS` and are dropped with a warning before validation.
"""

from __future__ import annotations

import difflib
import logging
from typing import Any

from pydantic import BaseModel

from slipstream.utils.logging import get_logger, log_rank0

logger = get_logger(__name__)

# DeepSpeed top-level sections we accept so existing configs load, but which have no effect here.
IGNORED_SECTIONS = (
    "autotuning",
    "elasticity",
    "compression_training",
    "data_efficiency",
    "curriculum_learning",
    "progressive_layer_drop",
    "eigenvalue",
    "quantize_training",
    "nebula",
    "hybrid_engine",
    "weight_quantization",
    "timers",
    "data_types",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "memory_breakdown",
    "dump_state",
    "sparse_gradients",
    "seq_parallel_communication_data_type",
    "graph_harvesting",
    "use_data_before_expert_parallelism",
    "disable_allgather",
)

_NOT_YET = "not used yet"
_MESH = "no effect until this parallelism is implemented (its size must be 1 for now)"
# key path -> why it has no effect. Keep docs/config.md's "Accepted; no effect" rows in step.
NO_EFFECT: dict[str, str] = {
    "torch_autocast.dtype": "torch_autocast itself is refused when enabled",
    "torch_autocast.lower_precision_safe_modules": "torch_autocast itself is refused when enabled",
    "bf16.immediate_grad_update": _NOT_YET,
    "zero_optimization.contiguous_gradients": "gradients always live in one contiguous buffer",
    "zero_optimization.reduce_scatter": "stages 1 and 2 always reduce-scatter; stage 0 all-reduces",
    "zero_optimization.allgather_partitions": "updated weights are always all-gathered",
    "zero_optimization.allgather_bucket_size": "weights are all-gathered once per reduce bucket (reduce_bucket_size)",
    "zero_optimization.use_multi_rank_bucket_allreduce": _NOT_YET,
    "zero_optimization.load_from_fp32_weights": "checkpoints always load the fp32 masters",
    "zero_optimization.elastic_checkpoint": "every checkpoint loads at any world size",
    "zero_optimization.ignore_unused_parameters": "unused parameters are always allowed",
    "zero_optimization.round_robin_gradients": _NOT_YET,
    "zero_optimization.offload_optimizer.buffer_count": "the NVMe store always uses three sub-group buffers",
    "zero_optimization.offload_optimizer.pipeline_read": "NVMe reads are always pipelined",
    "zero_optimization.offload_optimizer.pipeline_write": "NVMe writes are always pipelined",
    "zero_optimization.offload_optimizer.fast_init": _NOT_YET,
    "zero_optimization.offload_optimizer.ratio": "the whole partition is offloaded",
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": "the CPU Adam uses torch.get_num_threads() threads",
    "zero_optimization.offload_param.buffer_count": "one read-ahead unit",
    "zero_optimization.offload_param.buffer_size": "buffers are sized per unit",
    "zero_optimization.offload_param.max_in_cpu": _NOT_YET,
    "zero_optimization.stage3_model_persistence_threshold": _NOT_YET,
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "engine.consolidated_state_dict() gathers at every stage",
    "zero_optimization.stage3_module_granularity_threshold": "units are chosen by stage3_unit_modules",
    "zero_optimization.use_all_reduce_for_fetch_params": _NOT_YET,
    "zero_optimization.allgather_sequential": _NOT_YET,
    "zero_optimization.parameter_alignment": _NOT_YET,
    "zero_optimization.compute_grad_norm": "the global gradient norm is always computed (it is the overflow check)",
    "zero_optimization.memory_efficient_linear": _NOT_YET,
    "zero_optimization.override_module_apply": _NOT_YET,
    "zero_optimization.log_trace_cache_warnings": "stage 3 prefetches in module order, without a trace",
    "zero_optimization.pipeline_loading_checkpoint": _NOT_YET,
    "zero_optimization.mics_hierarchical_params_gather": "a MiCS shard group gathers in one collective",
    "aio.single_submit": "no libaio submission queue",
    "aio.overlap_events": "I/O always overlaps compute",
    "aio.use_gds": _NOT_YET,
    "comms_logger.prof_all": _NOT_YET,
    "comms_logger.prof_ops": _NOT_YET,
    "comms_logger.debug": _NOT_YET,
    "checkpoint.load_universal": "every slipstream checkpoint is universal",
    "checkpoint.use_node_local_storage": "every rank writes into save_dir, which must be shared between nodes",
    "checkpoint.parallel_write.pipeline_stage": "no pipeline-parallel checkpoint writing yet",
    "checkpoint.writer": "slipstream's writer streams already",
    **{
        f"tensor_parallel.{key}": _MESH
        for key in (
            "tp_overlap_comm",
            "preset_model",
            "keep_module_on_host",
            "replace_with_kernel_inject",
            "dtype",
            "tp",
            "injection_policy_tuple",
        )
    },
    **{
        f"compile.{key}": "DeepCompile's passes are not slipstream's: compile.deepcompile compiles each block (docs/compile.md)"
        for key in (
            "free_activation",
            "free_activation_threshold",
            "offload_activation",
            "offload_opt_states",
            "offload_parameters",
            "double_buffer",
            "symmetric_memory",
            "dump_graphs",
            "debug_log",
            "sync_before_reduce",
            "sync_after_reduce",
            "sync_before_allgather",
            "sync_after_allgather",
            "keep_int_input_tensors",
            "keep_all_input_tensors",
        )
    },
    "pipeline.seed_layers": "stages are cut from the model as built; layers are not re-initialised per stage",
    "pipeline.activation_checkpoint_interval": "use the activation_checkpointing section; it applies to every stage",
    "pipeline.pipe_partitioned": "activations cross stage boundaries whole (tensor-parallel ranks each send their copy)",
    "pipeline.grad_partitioned": "gradients cross stage boundaries whole",
    **{
        f"expert_parallel.{key}": "slipstream finds the experts itself (transformers' fused MoE experts, slipstream.moe.MoE); AutoEP's presets and patterns are not read"
        for key in (
            "preset_model",
            "moe_layer_pattern",
            "expert_pattern",
            "router_pattern",
            "use_grouped_mm",
            "grouped_mm_backend",
            "route_norm",
            "route_scale",
            "score_apply",
            "score_func",
            "num_expert_groups",
            "num_limited_groups",
            "top_k",
            "load_balance_coeff",
            "routed_scaling_factor",
            "expert_w1",
            "expert_w2",
            "expert_w3",
            "num_experts_attr",
            "top_k_attr",
            "has_shared_experts",
            "shared_experts_pattern",
        )
    },
    # expert parallelism is dropless: a capacity (and dropping what exceeds it) is never applied
    "expert_parallel.drop_tokens": "slipstream's expert parallelism is dropless, so no token is dropped",
    "expert_parallel.capacity_factor": "slipstream's expert parallelism is dropless: experts take every token routed to them",
}

_warned: set[str] = set()  # NO_EFFECT keys already warned about in this process


def warn_no_effect(config: BaseModel) -> list[str]:
    """Warn (once per process each) about NO_EFFECT keys set to a non-default value; return their paths."""
    found = []
    for path, why in NO_EFFECT.items():
        *sections, key = path.split(".")
        node: Any = config
        for name in sections:
            node = getattr(node, name, None)
        if not isinstance(node, BaseModel):
            continue
        field = type(node).model_fields[key]
        default = field.get_default(call_default_factory=True)
        value = getattr(node, key)
        if value == default:
            continue
        found.append(path)
        if path not in _warned:
            _warned.add(path)
            log_rank0(  # every rank reads the same file: say it once
                logger,
                "config: %s = %r has no effect in slipstream (%s); accepted for DeepSpeed compatibility",
                path,
                value,
                why,
                level=logging.WARNING,
            )
    return found


def split_unknown_top_level(raw: dict[str, Any], known: list[str]) -> dict[str, Any]:
    """Remove and return the unknown top-level keys real files carry (``_comment``, ``cuda_visible_devices``).

    DeepSpeed ignores unknown top-level keys; so do we, with one warning naming them. A near miss
    of a known key (``gradient_acumulation_steps``) stays in ``raw``, so it is an error with a
    did-you-mean: a typo must never silently fall back to a default. Keys inside sections stay strict.
    """
    choices = [*known, *IGNORED_SECTIONS]
    unknown = {
        key: raw[key]
        for key in list(raw)
        if key not in choices and (key.startswith("_") or not difflib.get_close_matches(key, choices, n=1, cutoff=0.8))
    }
    for key in unknown:
        del raw[key]
    if unknown:
        logger.warning(
            "config: ignoring unknown top-level key(s) %s (DeepSpeed ignores them too)", ", ".join(map(repr, unknown))
        )
    return unknown
