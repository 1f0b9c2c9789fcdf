"""The router (load-balancing) loss of the whole micro-batch under sequence sharding.

[Note: router statistics of the whole micro-batch] A mixture-of-experts model trained with its
balancing loss (transformers' ``output_router_logits``: Mixtral, Qwen2/3-MoE, OLMoE, Granite-MoE,
…) computes it in its forward from every layer's router logits: ``E · Σ_e f_e · P_e``, with ``f_e``
the share of (token, choice) pairs routed to expert ``e`` and ``P_e`` its mean router probability,
both means over the micro-batch's tokens (masked by a 2-D ``attention_mask``). A product of two
means is not a sum over tokens, so a sequence shard's own value is not a share of the whole one:
computed per shard it trains wrong (the twin check refused it). So the router logits the model's
loss reads are the whole micro-batch's:

- a forward hook on the model's base model (the module whose output carries ``router_logits``, which
  the causal-LM head passes to its loss function) replaces each layer's local logits ``[b·n, E]`` by
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
from slipstream.engine.parallel.sequence.logits import gather_in_order, group_positions

ROUTER_FIELD = "router_logits"


class _GatherRouterLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: dist.ProcessGroup, order: torch.Tensor, mine: torch.Tensor, batch: int, length: int, keep: torch.Tensor | None) -> torch.Tensor:  # type: ignore[override]
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


class WholeRouterLogits:
    """Makes the router logits of a sharded micro-batch the whole micro-batch's (the note).

    ``step()`` answers the running micro-batch's (batch rows, caller's length, padded length, valid tokens or None),
    or None when no sharded forward runs."""

    def __init__(self, model: torch.nn.Module, group: dist.ProcessGroup, positions: Callable[[int, int], torch.Tensor], step: Callable[[], tuple[int, int, int, torch.Tensor | None] | None]) -> None:  # fmt: skip
        self.group, self.positions, self.step = group, positions, step
        self.coefficient: float | None = getattr(model, "router_aux_loss_coef", None)
        base = getattr(model, "base_model", None)
        target = base if isinstance(base, torch.nn.Module) and base is not model else None
        self._hook = target.register_forward_hook(self._made_whole) if target is not None else None

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _made_whole(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.apply(output)

    def apply(self, output: Any) -> bool:
        """Replace ``output.router_logits`` (a tensor per layer) by the whole micro-batch's; True if it had any."""
        logits = getattr(output, ROUTER_FIELD, None) if hasattr(output, "keys") else None
        step = self.step()
        if logits is None or step is None:
            return False
        layers = logits if isinstance(logits, (tuple, list)) else (logits,)
        if not layers or not all(isinstance(t, torch.Tensor) for t in layers):
            return False
        batch, length, padded, keep = step
        made = []
        for local in layers:
            if getattr(local, "_slipstream_whole", False):  # made whole already (the hook's, passed on by the head)
                made.append(local)
                continue
            tokens = local.shape[0] * (local.shape[1] if local.dim() == 3 else 1)
            if local.dim() not in (2, 3) or tokens * dist.get_world_size(self.group) != batch * padded:
                return False  # not per token of this micro-batch: left as it is
            order, mine = group_positions(self.group, self.positions, padded, local.device)
            whole = _GatherRouterLogits.apply(local, self.group, order, mine, batch, length, keep)
            whole._slipstream_whole = True  # type: ignore[attr-defined]
            made.append(whole)
        setattr(output, ROUTER_FIELD, type(logits)(made) if isinstance(logits, (tuple, list)) else made[0])
        return True
