"""``slipstream.moe.MoE``: a drop-in for DeepSpeed's classic MoE layer, dropless, for custom models.

    from slipstream.moe import MoE
    self.moe = MoE(hidden_size=512, expert=MyMLP(512), num_experts=8, ep_size=2, k=2)
    output, aux_loss, expert_counts = self.moe(hidden_states)

The layer holds ``num_experts`` copies of ``expert`` and a linear router; every token goes to its
top-``k`` experts, weighted by the renormalised router probabilities, and no token is ever dropped
(``capacity_factor``, ``drop_tokens`` and the other capacity knobs are accepted for compatibility
and have no effect). ``aux_loss`` is the usual load-balancing loss ``E · Σ_e f_e · p_e`` (the
fraction of choices and the mean router probability of expert ``e``). In one process the layer
computes every expert; under ``slipstream.initialize`` with ``expert_parallel.autoep_size`` = e
(or the layer's ``ep_size``, which must agree), each rank keeps ``num_experts / e`` of them under
their global indices and tokens reach them by all-to-all (engine/parallel/expert/).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["MoE"]


class MoE(torch.nn.Module):
    """Mixture of experts: ``forward(hidden_states) -> (output, aux_loss, expert_counts)``."""

    def __init__(
        self,
        hidden_size: int,
        expert: torch.nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        **_compat: Any,
    ) -> None:
        super().__init__()
        if num_experts < 1 or not 1 <= k <= num_experts:
            raise ValueError(f"MoE: need 1 <= k <= num_experts, got k={k}, num_experts={num_experts}")
        if num_experts % ep_size:
            raise ValueError(f"MoE: num_experts {num_experts} does not divide by ep_size {ep_size}")
        if use_residual:
            raise ValueError("MoE: use_residual (PR-MoE) is not supported yet")
        self.hidden_size, self.num_experts, self.ep_size, self.k = hidden_size, num_experts, ep_size, k
        self.gate = torch.nn.Linear(hidden_size, num_experts, bias=False)
        # a ModuleDict keyed by the global expert index: expert parallelism keeps a subset under the same names
        self.experts = torch.nn.ModuleDict({str(e): copy.deepcopy(expert) for e in range(num_experts)})
        self.dispatch: Any = None  # set by expert parallelism: (hidden, index, weights, compute) -> output

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, self.hidden_size)
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, index = probs.topk(self.k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        counts = torch.bincount(index.reshape(-1), minlength=self.num_experts)
        fraction = counts.float() / index.numel()
        aux_loss = self.num_experts * torch.sum(fraction * probs.mean(0))
        if self.dispatch is not None:
            out = self.dispatch(x, index, weights)
        else:
            out = torch.zeros_like(x)
            for e in range(self.num_experts):
                token, slot = (index == e).nonzero(as_tuple=True)
                if token.numel():
                    out = out.index_add(0, token, self.experts[str(e)](x[token]) * weights[token, slot, None])
        return out.reshape(shape), aux_loss, counts
