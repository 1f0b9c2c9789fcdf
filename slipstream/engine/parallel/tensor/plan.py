"""Which leaves to shard and how: from the config, from the Hugging Face model, or inferred.

[Note: where the plan comes from] In order: the config's ``partition_config`` (DeepSpeed's
``layer_specs``: regexes over parameter names, ``partition_type`` row / column / skip, an optional
``shape`` ``[k, -1]`` for a projection packing ``k`` parts); then the model's own
``base_model_tp_plan`` (transformers: ``layers.*.self_attn.q_proj`` → ``colwise``); then
inference. With ``use_default_specs`` (the default) the later sources fill in what the earlier
ones leave unmatched.

[Note: inference] Within each repeated block, the linear-like leaves (``nn.Linear``,
transformers' ``Conv1D``) are taken in execution order and grouped by data flow (traced once through
the autograd graph of the probe batch, ``probe.leaf_inputs``): leaves that read none of the
open group's outputs are column-parallel, and the first leaf that reads one is the group's
row-parallel end, so the activation between them stays sharded and the group costs one all-reduce
each way. Leaves that no row closes stay replicated. This does not depend on module nesting: BERT's
attention spreads its projections over ``attention.self`` and ``attention.output``, and its MLP over
two sibling modules. Without a trace (no gradients reach the leaves), leaves are grouped by their
parent module, the last of each group being the row. A group
with one column leaf whose output is ``k`` times the row leaf's input (GPT-2's ``c_attn`` = Q|K|V,
``k`` = 3; a fused gate|up, ``k`` = 2) is a packed projection, sharded per part so each rank keeps
whole heads of Q, K and V. A parent with a single leaf stays replicated.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from slipstream.engine.config import ConfigError
from slipstream.utils.logging import get_logger, log_rank0

logger = get_logger(__name__)

# DeepSpeed's keys (deepspeed/module_inject/autotp_config.py). Without effect here: tp_size (autotp_size
# rules), embedding_partition_dim and lm_head_patterns (the vocabulary layers are found through the model's
# get_input/output_embeddings), gather_output, grad_allreduce (partial gradients are found by the self-check
# replay: partial_grads.py) and partition_dim (the partition follows the layer's orientation).
TOP_KEYS = {"use_default_specs", "layer_specs", "strict_mode", "tp_size", "embedding_partition_dim", "lm_head_patterns"}
LAYER_SPEC_KEYS = {
    "patterns",
    "partition_type",
    "shape",
    "partition_dim",
    "model_types",
    "gather_output",
    "grad_allreduce",
}
NO_EFFECT = {
    "tp_size",
    "embedding_partition_dim",
    "lm_head_patterns",
    "gather_output",
    "grad_allreduce",
    "partition_dim",
}
PARTITION_TYPES = {"row": "row", "column": "column", "skip": "skip", "rowwise": "row", "colwise": "column"}


@dataclasses.dataclass(frozen=True)
class PlanEntry:
    """One leaf to shard: its qualified name, ``column``/``row``, packed parts, and where the rule came from."""

    name: str
    style: str  # column | row | kv (a key/value projection with fewer heads than t: see layers.ShardedLinear)
    parts: int = 1
    source: str = "inferred"
    kv_heads: int = 0  # style kv: the projection's heads, each kept whole by t / kv_heads ranks
    gathered: bool = False  # column: output all-gathered; row: input split ([Note: gathered groups] in layers.py)

    def describe(self) -> str:
        packed = f" (packed {self.parts})" if self.parts > 1 else ""
        kv = f" ({self.kv_heads} KV head(s), each replicated on t/{self.kv_heads} ranks)" if self.kv_heads else ""
        gathered = (" (output gathered)" if self.style == "column" else " (input split)") if self.gathered else ""
        return f"{self.name}: {self.style}{packed}{kv}{gathered} [{self.source}]"


def is_linear_like(module: torch.nn.Module) -> bool:
    """``nn.Linear`` or a transformers-style ``Conv1D`` (2-D weight ``[in, out]`` with ``nf``/``nx``)."""
    if isinstance(module, torch.nn.Linear):
        return True
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and getattr(module, "weight", None) is not None


def out_features(module: torch.nn.Module) -> int:
    return module.weight.shape[0] if isinstance(module, torch.nn.Linear) else module.weight.shape[1]


def in_features(module: torch.nn.Module) -> int:
    return module.weight.shape[1] if isinstance(module, torch.nn.Linear) else module.weight.shape[0]


def validate_partition_config(section: dict[str, Any] | None) -> None:
    """Every mistake in ``tensor_parallel.partition_config`` as one ConfigError naming the key."""
    if section is None:
        return
    key = "tensor_parallel.partition_config"
    unknown = set(section) - TOP_KEYS
    if unknown:
        raise ConfigError(f"{key}: unknown key {sorted(unknown)[0]!r}; the keys are {', '.join(sorted(TOP_KEYS))}")
    specs = section.get("layer_specs", [])
    if not isinstance(specs, list):
        raise ConfigError(
            f"{key}.layer_specs: must be a list of {{patterns, partition_type}}, got {type(specs).__name__}"
        )
    no_effect = sorted(set(section) & NO_EFFECT) + sorted(
        {k for spec in specs if isinstance(spec, dict) for k in spec} & NO_EFFECT
    )
    if no_effect:
        log_rank0(
            logger,
            "config: %s.%s accepted for DeepSpeed compatibility, no effect in slipstream (see plan.py)",
            key,
            ", ".join(dict.fromkeys(no_effect)),
        )
    for i, spec in enumerate(specs):
        where = f"{key}.layer_specs[{i}]"
        if not isinstance(spec, dict):
            raise ConfigError(f"{where}: must be an object with patterns and partition_type")
        if set(spec) - LAYER_SPEC_KEYS:
            raise ConfigError(
                f"{where}: unknown key {sorted(set(spec) - LAYER_SPEC_KEYS)[0]!r}; the keys are {', '.join(sorted(LAYER_SPEC_KEYS))}"
            )
        patterns = spec.get("patterns")
        if not isinstance(patterns, list) or not patterns or not all(isinstance(p, str) for p in patterns):
            raise ConfigError(f"{where}.patterns: must be a non-empty list of regular expressions")
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ConfigError(f"{where}.patterns: {pattern!r} is not a regular expression ({err})") from None
        if str(spec.get("partition_type", "column")).lower() not in PARTITION_TYPES:
            raise ConfigError(
                f"{where}.partition_type: must be row, column or skip, got {spec.get('partition_type')!r}"
            )
        shape = spec.get("shape")
        if shape is not None and (
            not isinstance(shape, list) or len(shape) != 2 or not isinstance(shape[0], int) or shape[0] < 1
        ):
            unequal = isinstance(shape, list) and shape and isinstance(shape[0], list)
            raise ConfigError(
                f"{where}.shape: must be [parts, -1] (a packed projection of equal parts), got {shape!r}"
                + (
                    "; packed parts of unequal sizes are not supported yet: list the projections separately"
                    if unequal
                    else ""
                )
            )
        if "model_types" in spec and not (
            isinstance(spec["model_types"], list) and all(isinstance(m, str) for m in spec["model_types"])
        ):
            raise ConfigError(f"{where}.model_types: must be a list of model type names, got {spec['model_types']!r}")


def _from_partition_config(
    section: dict[str, Any], leaves: dict[str, torch.nn.Module], model_type: str | None
) -> dict[str, PlanEntry | None]:
    """Leaf name → entry (None: ``skip``, keep replicated) for every leaf a layer spec matches."""
    found: dict[str, PlanEntry | None] = {}
    for i, spec in enumerate(section.get("layer_specs", [])):
        if spec.get("model_types") and str(model_type).lower() not in [m.lower() for m in spec["model_types"]]:
            continue  # DeepSpeed's model_types: the spec applies to those models only
        style = PARTITION_TYPES[str(spec.get("partition_type", "column")).lower()]
        parts = spec["shape"][0] if spec.get("shape") else 1
        for name in leaves:
            if name in found:
                continue
            if any(re.match(p, f"{name}.weight") or re.fullmatch(p, name) for p in spec["patterns"]):
                source = f"partition_config.layer_specs[{i}]"
                found[name] = None if style == "skip" else PlanEntry(name, style, parts, source)
    return found


def hf_tp_plan(model: torch.nn.Module) -> dict[str, str]:
    """The model's ``base_model_tp_plan`` with names from the model's root (transformers)."""
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and not hasattr(model, prefix):
        prefix = ""
    return {(f"{prefix}.{k}" if prefix else k): v for k, v in plan.items()}


def _from_hf(plan: dict[str, str], leaves: dict[str, torch.nn.Module]) -> dict[str, PlanEntry]:
    found: dict[str, PlanEntry] = {}
    for pattern, kind in plan.items():
        style = "column" if "colwise" in kind else "row" if "rowwise" in kind else None
        if style is None:
            continue
        # transformers' colwise_gather_output / rowwise_split_input: what runs between them sees whole tensors
        gathered = kind in ("colwise_gather_output", "rowwise_split_input")
        regex = re.compile(re.escape(pattern).replace(r"\*", r"\d+"))
        for name in leaves:
            if regex.fullmatch(name) and name not in found:
                found[name] = PlanEntry(name, style, 1, f"base_model_tp_plan[{pattern!r}]", gathered=gathered)
    return found


def _groups_by_data_flow(order: Sequence[str], inputs: dict[str, set[str]]) -> list[list[str]]:
    """Column leaves until one reads an open column's output: that one is the group's row ([Note: inference])."""
    groups, open_columns = [], []
    for name in order:
        if name not in inputs:
            continue
        if inputs[name] & set(open_columns):
            groups.append([*open_columns, name])
            open_columns = []
        else:
            open_columns.append(name)
    return groups


def _inferred(
    order: Sequence[str], leaves: dict[str, torch.nn.Module], inputs: dict[str, set[str]] | None = None
) -> dict[str, PlanEntry]:
    """See [Note: inference]."""
    groups: dict[str, list[str]] = {}
    if inputs:
        groups = {members[-1]: members for members in _groups_by_data_flow(order, inputs)}
    else:
        for name in order:
            groups.setdefault(name.rpartition(".")[0], []).append(name)
    found: dict[str, PlanEntry] = {}
    for members in groups.values():
        if len(members) < 2:
            continue
        *columns, row = members
        parts = 1
        if len(columns) == 1:
            ratio, rest = divmod(out_features(leaves[columns[0]]), in_features(leaves[row]))
            parts = ratio if ratio > 1 and rest == 0 else 1
        for name in columns:
            found[name] = PlanEntry(name, "column", parts)
        found[row] = PlanEntry(row, "row")
    return found


def build_plan(
    model: torch.nn.Module,
    block_leaves: dict[str, torch.nn.Module],
    order: Sequence[str],
    partition_config: dict[str, Any] | None,
    inputs: Callable[[], dict[str, set[str]]] | None = None,
) -> list[PlanEntry]:
    """The entries for the leaves of the blocks (``order``: execution order), first source that matches wins.
    ``inputs``: traces each leaf's source leaves in its block (probe.leaf_inputs), called only when the plan
    is inferred (a forward with gradients that a model's own plan makes unnecessary)."""
    chosen: dict[str, PlanEntry | None] = {}
    use_defaults = True
    if partition_config is not None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        chosen.update(_from_partition_config(partition_config, block_leaves, model_type))
        use_defaults = bool(partition_config.get("use_default_specs", True))
        unmatched = [name for name in order if name not in chosen]
        if partition_config.get("strict_mode") and unmatched:
            raise ConfigError(
                f"tensor_parallel.partition_config.strict_mode: {len(unmatched)} linear layer(s) match no layer spec "
                f"(first: {unmatched[0]}); add a spec (partition_type skip keeps one replicated) or turn strict_mode off"
            )
    if use_defaults:
        hf = _from_hf(hf_tp_plan(model), block_leaves)
        inferred = {} if hf else _inferred(order, block_leaves, inputs() if inputs is not None else None)
        for source in (hf, inferred):
            for name, entry in source.items():
                chosen.setdefault(name, entry)
    return [chosen[name] for name in order if chosen.get(name) is not None]  # type: ignore[misc]
