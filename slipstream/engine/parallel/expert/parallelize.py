"""Expert parallelism for unchanged Mixture-of-Experts models: find the experts, keep this rank's.

[Note: which modules] transformers' MoE models (Mixtral, Qwen-MoE and kin) hold their experts in
one module with fused 3-D weights (``[num_experts, ...]``) called as ``experts(hidden_states,
top_k_index, top_k_weights)``; the router before it and the auxiliary loss stay unchanged. Each
such module is replaced by :class:`ExpertParallelExperts` over ``mesh.group("ep")``.

[Note: expert gradients] Expert ``e`` lives on one rank of each ep group and receives the tokens
of every rank of that group, so its gradient is the *sum* over the ``ep`` ranks' losses. ZeRO
averages dense gradients over dp (the mean of the ranks' losses) and expert gradients over the
expert-data-parallel group (the ranks holding the same experts, ``dp/ep`` of them); dividing
expert gradients by ``ep`` first makes both the gradient of the dp-mean loss, as in one process.
When the ep group spans tensor-parallel ranks, they hold the same tokens and the same loss, so each
token reaches its expert once per tp rank: the sum counts it ``tp`` times and the division by ``ep``
still gives the mean. Under Megatron sequence parallelism each of those tp ranks holds a different
part of the sequence instead (the experts run in the sequence-sharded region), so a token reaches
its expert once and the parts add up to the whole loss's gradient: the divisor is ``ep / tp``
(``ExpertPlan.split_tokens``, set by the tensor step, which runs after this one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist

from slipstream.engine.config import ConfigError
from slipstream.engine.parallel.expert.dispatch import ExpertParallelExperts, dispatch_combine
from slipstream.engine.parallel.expert.options import ExpertOptions
from slipstream.engine.parallel.mesh import Mesh
from slipstream.moe import MoE
from slipstream.utils.logging import get_logger, log_rank0
from slipstream.utils.placement import place

logger = get_logger(__name__)


@dataclasses.dataclass
class ExpertPlan:
    """What the rest of initialize needs: the expert parameters and the group ZeRO shards them over."""

    params: list[torch.nn.Parameter]
    group: dist.ProcessGroup  # the expert-data-parallel group: ranks holding the same experts
    modules: list[ExpertParallelExperts]
    scale: _GradientScale  # the expert gradients' hook (see [Note: expert gradients])
    hooks: list[torch.utils.hooks.RemovableHandle] = dataclasses.field(default_factory=list)

    def split_tokens(self, shards: Callable[[], int]) -> None:
        """The ep group's ranks hold ``shards()`` different parts of each rank's tokens at the experts (Megatron
        sequence parallel: the tp ranks' sequence shards; 1 when it is off) — see [Note: expert gradients]."""
        self.scale.shards = shards

    def token_counts(self) -> tuple[tuple[int, ...], ...]:
        """Tokens each local expert received since the last call, per experts module (for the step record)."""
        return tuple(tuple(m.take_counts()) for m in self.modules)

    def close(self) -> None:
        """Remove the expert-gradient scalings (see [Note: expert gradients])."""
        for handle in self.hooks:
            handle.remove()
        self.hooks = []

    def split(self, groups: list[dict]) -> list[dict]:
        """Each optimizer parameter group cut into its dense part and its expert part (sharded over ``group``)."""
        experts = {id(p) for p in self.params}
        out = []
        for g in groups:
            params = list(g["params"])
            dense = [p for p in params if id(p) not in experts]
            mine = [p for p in params if id(p) in experts]
            if dense:
                out.append({**g, "params": dense})
            if mine:
                out.append({**g, "params": mine, "process_group": self.group})
        return out


class _GradientScale:
    """Divides each expert gradient by ``ep / shards`` (see [Note: expert gradients]); a gradient hook."""

    def __init__(self, ep: int) -> None:
        self.ep = ep
        self.shards: Callable[[], int] = lambda: 1

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        divisor = self.ep // self.shards()
        return grad if divisor == 1 else grad / divisor


def is_fused_experts(module: torch.nn.Module) -> bool:
    n = getattr(module, "num_experts", None)
    params = list(module.parameters(recurse=False))
    fused = bool(params) and all(p.dim() == 3 and p.shape[0] == n for p in params)
    return isinstance(n, int) and n > 1 and fused and hasattr(module, "gate_up_proj") and hasattr(module, "down_proj")


def parallelize_experts(model: torch.nn.Module, mesh: Mesh, options: ExpertOptions | None) -> ExpertPlan | None:
    """Replace every fused experts module by this rank's experts over ``mesh.group("ep")``; None when ep is 1. Collective."""
    if options is None:
        return None
    ep = options.size
    found = [(name, m) for name, m in model.named_modules() if is_fused_experts(m)]
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]
    if not found and not layers:
        raise ConfigError(
            "expert_parallel.autoep_size: no experts module found (transformers' fused MoE experts such as Mixtral's "
            "or Qwen-MoE's); this model cannot be expert-parallel"
        )
    for name, m in found + layers:
        if m.num_experts % ep:
            raise ConfigError(
                f"expert_parallel.autoep_size: {name} has {m.num_experts} experts, which do not divide by {ep}"
            )
    group = mesh.group("ep")
    scale = _GradientScale(ep)
    modules, hooks = [], []
    for name, m in found:
        sharded = ExpertParallelExperts(m, group)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, sharded)
        for pname, p in sharded.named_parameters(recurse=False):
            place(p, sharded.global_shapes[pname], (sharded.first, 0, 0))
            hooks.append(p.register_hook(scale))  # see [Note: expert gradients]
        modules.append(sharded)
    params = [p for m in modules for p in m.parameters(recurse=False)]
    for name, layer in layers:
        params += _keep_local_experts(name, layer, group, ep, hooks, scale)
    log_rank0(
        logger, "expert parallel %d: %d experts modules, %d expert parameters per rank", ep, len(modules), len(params)
    )
    return ExpertPlan(params, mesh.across("ep"), modules, scale, hooks)  # the expert-data-parallel group


def _keep_local_experts(
    name: str,
    layer: MoE,
    group: dist.ProcessGroup,
    ep: int,
    hooks: list[torch.utils.hooks.RemovableHandle],
    scale: _GradientScale,
) -> list[torch.nn.Parameter]:
    """A ``slipstream.moe.MoE`` keeps its own experts (their global indices as names) and dispatches by all-to-all."""
    if layer.ep_size not in (1, ep):
        raise ConfigError(
            f"expert_parallel.autoep_size: {ep}, but the MoE layer {name} was built with ep_size={layer.ep_size}"
        )
    local = layer.num_experts // ep
    first = dist.get_rank(group) * local
    for e in list(layer.experts.keys()):
        if not first <= int(e) < first + local:
            del layer.experts[e]

    def compute(e: int, rows: torch.Tensor) -> torch.Tensor:
        return layer.experts[str(first + e)](rows)

    layer.dispatch = lambda x, index, weights: dispatch_combine(x, index, weights, group, local, compute)
    params = [p for p in layer.experts.parameters()]
    for p in params:
        place(p, tuple(p.shape))  # whole tensors under global names: other ranks' experts are other parameters
        hooks.append(p.register_hook(scale))  # see [Note: expert gradients]
    return params
