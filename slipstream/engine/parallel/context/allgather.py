"""Context parallelism by all-gathered K/V: the simpler variant of ring attention.

[Note: all-gather K/V] Each rank all-gathers every rank's K|V (one packed all-gather per layer
forward; its backward is one reduce-scatter of dK|dV) and attends its own queries to the whole
sequence with a mask built from the global positions (token_layout.py), so contiguous and zig-zag shards
both work. Simpler and with fewer, larger messages than the ring, at the cost of holding the whole
sequence's K/V on every rank during the layer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from slipstream import comm
from slipstream.engine.parallel.attention import allowed, attend, attention_features
from slipstream.engine.parallel.context.token_layout import Layout
from slipstream.engine.parallel.segments import Segments
from slipstream.errors import UsageError
from slipstream.utils.eager_island import declare, island


class _GatherKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, kv: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        size = dist.get_world_size(group)
        flat = torch.empty(size * kv.numel(), dtype=kv.dtype, device=kv.device)  # written by the backend: not a view
        comm.all_gather_into_tensor(flat, kv.reshape(-1).clone(), group=group, tag="context k|v all-gather").wait()
        return flat.view(size, *kv.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        mine = torch.empty(grad[0].numel(), dtype=grad.dtype, device=grad.device)
        comm.reduce_scatter_tensor(
            mine, grad.reshape(-1).clone(), group=ctx.group, tag="context dk|dv reduce-scatter (backward)"
        ).wait()
        return mine.view(grad.shape[1:]), None


def _gathered_meta(kv: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return kv.new_empty((dist.get_world_size(group), *kv.shape))


declare(_GatherKV, _gathered_meta)


class AllGatherKVAttention:
    """The attention function registered with transformers for ``context_parallel.method = "allgather_kv"``.

    Queries see the whole sequence's keys, so causality, sliding windows, soft-capping, padding and packed
    documents are exact (a mask from the global positions and the step's segments; parallel/attention.py);
    anything else is refused.
    """

    def __init__(self, group: dist.ProcessGroup, layout: Layout) -> None:
        self.group, self.layout = group, layout
        self.rank = dist.get_rank(group)
        self.active = False  # set by the engine's sharder for its steps only
        self.segments: Segments | None = (
            None  # the step's padding and documents (parallel/segments.py), from the sharder
        )

    def __call__(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        dropout: float = 0.0,
        scaling: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        if not self.active:
            raise UsageError(
                "context_parallel: attention called outside the engine's sharded step (the model's own attention runs there)"
            )
        features = attention_features(
            "context_parallel.method: all-gathered K/V attention", module, dropout, scaling, kwargs
        )
        b, heads, n, d = query.shape
        kv_heads = key.shape[1]
        gathered = island(_GatherKV, (torch.cat([key, value], dim=1),), (self.group,))  # [c, b, 2·Hkv, n, d]
        k = gathered[:, :, :kv_heads].permute(1, 2, 0, 3, 4).reshape(b, kv_heads, -1, d)
        v = gathered[:, :, kv_heads:].permute(1, 2, 0, 3, 4).reshape(b, kv_heads, -1, d)
        if heads != kv_heads:
            k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
        length = n * self.layout.size
        q_pos = self.layout.positions(self.rank, length).to(query.device)
        k_pos = torch.cat([self.layout.positions(r, length) for r in range(self.layout.size)]).to(query.device)
        out = attend(query, k, v, features, allowed(features, q_pos, k_pos, self.segments), module.training)
        return out.transpose(1, 2).contiguous(), None
