"""Dropless expert-parallel experts: tokens go to the rank that owns their expert and come back.

[Note: dispatch and combine] The router runs unchanged on every rank and picks ``k`` experts per
token. Each (token, choice) pair is sent to the rank owning that expert (experts are cut into
``ep`` contiguous ranges, ``E/ep`` per rank): the pairs are sorted by owner, the counts exchanged
with one even all-to-all, the hidden states sent with one uneven ``all_to_all_single`` (each
rank's input sent once per choice that leaves it), computed by the local experts, sent back the
same way and combined with the router weights where they came from. No capacity, no dropped
token: the result is the unsharded layer's. Both exchanges are differentiable (backward runs the
reverse exchange). Per layer and micro-batch a rank sends ``Σ(choices routed to other ranks)·h``
elements to dispatch and receives as many back to combine (plus the counts). Each exchange is
waited on through ``overlap.wait``: inside a DualPipeV pair the other micro-batch computes meanwhile.

[Note: a rank no token reached] When the router sends no (token, choice) to any of a rank's experts
(a collapsed router, a NaN step, a tiny micro-batch at large ``ep``), that rank receives zero rows and
computes nothing. Its combine input would then be a fresh zero tensor outside the autograd graph, so
its backward would skip both reverse exchanges while every other rank waits in them: a hang until the
timeout. The empty ``arrived`` is therefore cloned (an empty tensor that keeps its grad_fn), so every
rank runs the same exchanges in backward, whatever the routing.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from slipstream import comm
from slipstream.comm import overlap
from slipstream.utils.eager_island import declare, island, register


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup, tag: str) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    overlap.wait(comm.all_to_all_v(out, x.contiguous(), recv, send, group=group, tag=tag))
    return out


class _AllToAllV(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup, tag: str
    ) -> torch.Tensor:  # type: ignore[override]
        ctx.send, ctx.recv, ctx.group, ctx.tag = send, recv, group, tag
        return _exchange(x, send, recv, group, tag)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return _exchange(grad, ctx.recv, ctx.send, ctx.group, ctx.tag + " (backward)"), None, None, None, None


def dispatch_combine(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    group: dist.ProcessGroup,
    local: int,
    compute: Any,
) -> torch.Tensor:
    """Send each (token, choice) to the owner of its expert, ``compute(local expert, rows)`` there, combine here.

    Experts are owned in contiguous ranges of ``local`` per rank of ``group``.
    """
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    tokens, k = top_k_index.shape
    experts = top_k_index.reshape(-1)
    owner = experts // local
    order = torch.argsort(owner, stable=True)
    token_of = torch.arange(tokens, device=hidden_states.device).repeat_interleave(k)[order]
    send = torch.bincount(owner, minlength=ep)
    recv = torch.empty_like(send)
    overlap.wait(comm.all_to_all_single(recv, send, group=group, tag="expert token counts"))
    send_l, recv_l = send.tolist(), recv.tolist()
    sent_experts = _exchange(experts[order], send_l, recv_l, group, "expert ids")  # no gradient
    arrived = _AllToAllV.apply(hidden_states[token_of], send_l, recv_l, group, "expert dispatch")
    mine = sent_experts - rank * local
    # an empty ``arrived`` stays in the graph (see [Note: a rank no token reached])
    out = arrived.clone() if not arrived.shape[0] else torch.zeros_like(arrived)
    for e in range(local):
        rows = (mine == e).nonzero().squeeze(-1)
        if rows.numel():
            out.index_add_(0, rows, compute(e, arrived[rows]).to(out.dtype))  # in place: no copy of ``out`` per expert
    back = _AllToAllV.apply(out, recv_l, send_l, group, "expert combine")
    weights = top_k_weights.reshape(-1)[order].unsqueeze(-1).to(back.dtype)
    return torch.zeros_like(hidden_states).index_add(0, token_of, (back * weights).to(hidden_states.dtype))


class ExpertParallelExperts(torch.nn.Module):
    """A fused-3-D experts module (transformers' ``MixtralExperts`` and kin) holding this rank's experts only.

    Parameters keep their names and hold experts ``[first, first + E/ep)`` of the global tensors.
    """

    def __init__(self, source: torch.nn.Module, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.group, self.ep, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.num_experts = source.num_experts
        self.local = self.num_experts // self.ep
        self.first = self.rank * self.local
        self.act_fn = source.act_fn
        self.global_shapes: dict[str, tuple[int, ...]] = {}
        for name, p in source.named_parameters(recurse=False):
            self.global_shapes[name] = tuple(p.shape)
            piece = p.detach()[self.first : self.first + self.local].clone()
            self.register_parameter(name, torch.nn.Parameter(piece, requires_grad=p.requires_grad))
        self.tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.long)  # this rank's choices, last forward
        self._window = torch.zeros(self.num_experts, dtype=torch.long)  # summed since the last take_counts()
        register(self)  # a static argument of its eager island (utils/eager_island.py)

    def take_counts(self) -> list[int]:
        """This rank's choices of each expert since the last call (the engine reports them per step)."""
        counts, self._window = self._window.tolist(), torch.zeros_like(self._window)
        return counts

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = torch.nn.functional.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return torch.nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e])

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        # one eager island in a compiled block: the routing is data-dependent and talks to the group
        return island(_experts, (hidden_states, top_k_index, top_k_weights), (self,))

    def dispatch(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        self.tokens_per_expert = torch.bincount(top_k_index.reshape(-1), minlength=self.num_experts).cpu()
        if torch.is_grad_enabled():  # a training forward (activation checkpointing's recompute counts again)
            self._window += self.tokens_per_expert
        return dispatch_combine(hidden_states, top_k_index, top_k_weights, self.group, self.local, self._expert)


def _experts(
    hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, experts: ExpertParallelExperts
) -> torch.Tensor:
    return experts.dispatch(hidden_states, top_k_index, top_k_weights)


def _experts_meta(hidden_states: torch.Tensor, *_: Any) -> torch.Tensor:
    return torch.empty_like(hidden_states)


declare(_experts, _experts_meta)
