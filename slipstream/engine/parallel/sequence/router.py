"""The router (load-balancing) loss of the whole micro-batch under sequence sharding.

[Note: router statistics of the whole micro-batch] A mixture-of-experts model trained with its
balancing loss (transformers' ``output_router_logits``: Mixtral, Qwen2/3-MoE, OLMoE, Granite-MoE,
…) computes it in its forward from every layer's router logits: ``E · Σ_e f_e · P_e``, with ``f_e``
the share of (token, choice) pairs routed to expert ``e`` and ``P_e`` its mean router probability,
both means over the micro-batch's tokens (masked by a 2-D ``attention_mask``). A product of two
means is not a sum over tokens, so a sequence shard's own value is not a share of the whole one:
computed per shard it trains wrong (the twin check refused it). So the router logits the model's
loss reads are the whole micro-batch's:

- a forward hook on the model's base model (``parallel/router_logits.py``: the module whose output
  carries ``router_logits``, which the causal-LM head passes to its loss function) replaces each layer's local logits ``[b·n, E]`` by
  the group's, gathered in global token order with the engine's fill cut off and, where the batch
  has padding, only its valid tokens: the masked means one process takes are the plain means over
  those tokens, and under sharding the model sees no mask (the sharder hands it to the kernels).
  A ``router_logits`` output the model does not consume (a custom model returning them to the
  caller) is made whole by the sharder's combine the same way.
- Gradient: every rank of the group now computes the same balancing term ``T`` from the same
  logits, and its loss carries it with the weight the combine gives that rank's loss (``u·n_r/N``
  of inputs.py's note; ``u`` with the caller's ``num_items_in_batch``). The backward of this gather
  is therefore the true adjoint of an all-gather: each rank's gradient of the whole logits, summed
  over the group (one all-reduce of ``b·s·E`` values, ``E`` the experts: small), this rank's tokens
  kept. Rank ``r``'s logits then receive ``Σ_q u·n_q/N · ∂T/∂z_r = u·∂T/∂z_r`` and the engine's mean
  over the ``u`` ranks gives ``∂T`` exactly once. With ``num_items_in_batch`` the shards' losses are
  summed, which would count ``T`` ``u`` times: there the combine takes ``(u-1)/u`` of the model's
  own ``router_aux_loss_coef · aux_loss`` back out of each rank's loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from slipstream import comm
from slipstream.engine.parallel.router_logits import RouterLogitsHook
from slipstream.engine.parallel.sequence.logits import gather_in_order, group_positions


class _GatherRouterLogits(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        local: torch.Tensor,
        group: dist.ProcessGroup,
        order: torch.Tensor,
        mine: torch.Tensor,
        batch: int,
        length: int,
        keep: torch.Tensor | None,
    ) -> torch.Tensor:  # type: ignore[override]
        """``local``: [b·n, E] (tokens flattened before the router, as transformers does) or [b, n, E];
        ``keep``: [b, length] bool, the valid tokens (None: all)."""
        shaped = local.reshape(batch, -1, local.shape[-1])
        whole = gather_in_order(shaped, group, order, "sequence-parallel router logits all-gather")
        ctx.save_for_backward(mine, keep)
        ctx.group, ctx.shape, ctx.batch, ctx.padded, ctx.length = group, local.shape, batch, whole.shape[1], length
        cut = whole[:, :length]
        if keep is not None:
            return cut[keep]
        return cut if local.dim() == 3 else cut.reshape(-1, local.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        mine, keep = ctx.saved_tensors
        full = grad.new_zeros(ctx.batch, ctx.padded, ctx.shape[-1])
        if keep is not None:
            full[:, : ctx.length][keep] = grad
        else:
            full[:, : ctx.length] = grad.reshape(ctx.batch, ctx.length, -1)
        # each rank's copy of the loss weighs these logits its own way: the adjoint sums them (the note)
        comm.all_reduce(full, group=ctx.group, tag="sequence-parallel router logits (backward)").wait()
        return full[:, mine].reshape(ctx.shape), None, None, None, None, None, None


def whole_router_logits(
    model: torch.nn.Module,
    group: dist.ProcessGroup,
    positions: Callable[[int, int], torch.Tensor],
    step: Callable[[], tuple[int, int, torch.Tensor | None] | None],
) -> RouterLogitsHook:
    """The hook of the note for a sequence group: ``positions(rank, padded)`` its layout; ``step()`` the running
    micro-batch's (caller's length, padded length, valid tokens or None), None when no sharded forward runs."""

    def whole(local: torch.Tensor, rows: int) -> torch.Tensor | None:
        running = step()
        if running is None:
            return None
        length, padded, keep = running
        tokens = local.shape[0] * (local.shape[1] if local.dim() == 3 else 1)
        if tokens * dist.get_world_size(group) != rows * padded:
            return None  # not per token of this micro-batch: left as it is
        order, mine = group_positions(group, positions, padded, local.device)
        return _GatherRouterLogits.apply(local, group, order, mine, rows, length, keep)  # type: ignore[no-any-return]

    return RouterLogitsHook(model, whole)
