"""The one initial weight synchronisation: every rank starts from global rank 0's model.

[Note: one sync, before any cut] Done once, world-wide, before the pipeline, experts or tensor
parallelism cut the model: every rank then cuts its piece out of the same weights, so the pieces
agree with each other and with one process's model, and ZeRO's groups (dense, expert-data) need
no second broadcast. Tensors already placed as pieces (``utils.placement``) are left alone; a model
built under ``zero.Init`` syncs its buffers only (its parameters are already this rank's shards,
made from the same seed on every rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from slipstream import comm
from slipstream.utils.placement import placement_of


def sync_initial_weights(model: torch.nn.Module, parameters: bool = True) -> None:
    """Broadcast rank 0's parameters (``parameters=False``: none) and buffers to every rank: one flat broadcast per dtype."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    tensors = [t for t in (*(model.parameters() if parameters else ()), *model.buffers()) if placement_of(t) is None]
    by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for (dtype, _), group in by_dtype.items():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            comm.broadcast(flat, src=0, tag=f"initial {dtype} weights").wait()
            torch._foreach_copy_(group, [c.view_as(t) for c, t in zip(flat.split([t.numel() for t in group]), group)])
