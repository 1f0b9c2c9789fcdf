"""Replicated parameters that see only this rank's part of an activation: their gradients are summed over tp.

[Note: partial gradients] A parameter every tp rank holds whole but applies to a sharded
activation gets only this rank's share of its gradient: a per-head norm inside attention (Qwen3's
``q_norm``/``k_norm``, applied to this rank's heads), or under sequence parallelism every norm and
row bias of the blocks (applied to this rank's part of the sequence). Summing the shares over tp
gives the gradient of the unsharded model. The parameters inside the sharded regions are found
by replaying the first block's self-check call and noting which modules run between a sub-block's
column layers and its row layer (blocks are alike, so the same relative names hold in every block).
The sum is a hook on the gradient, so it runs before accumulation (gradient accumulation stays
exact) and before ZeRO's post-accumulate hooks see the gradient.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from slipstream.comm import all_reduce
from slipstream.engine.parallel.tensor.layers import ShardedLinear, TPContext


def params_in_sharded_regions(
    blocks: Sequence[torch.nn.Module], call: tuple[Any, Any] | None, ctx: TPContext
) -> list[torch.nn.Parameter]:
    """Replicated parameters of modules that run inside a sharded (column → row) region, in every block."""
    if call is None or ctx.rng is None:
        return []
    first = blocks[0]
    inside: set[str] = set()
    handles = []
    for name, module in first.named_modules():
        if isinstance(module, ShardedLinear) or not any(True for _ in module.parameters(recurse=False)):
            continue
        handles.append(
            module.register_forward_pre_hook(lambda m, a, name=name: inside.add(name) if ctx.rng.inside else None)
        )
    modes = {m: m.training for m in first.modules()}
    first.eval()
    try:
        with torch.no_grad():
            first(*call[0], **call[1])
    finally:
        for handle in handles:
            handle.remove()
        for module, mode in modes.items():
            module.training = mode
        ctx.rng.leave()
    found = []
    for block in blocks:
        held = dict(block.named_modules())  # a module only the first block has (T5's relative bias) is in no other
        for name in sorted(inside & held.keys()):
            found += [p for p in held[name].parameters(recurse=False) if p.requires_grad]
    return found


def sum_gradients_over_tp(
    params: Iterable[torch.nn.Parameter], ctx: TPContext, tag: str, only_under_sp: bool = False
) -> list[Any]:
    """Hook each parameter's gradient to be all-reduced over tp (see [Note: partial gradients])."""

    def reduce(grad: torch.Tensor) -> torch.Tensor:
        if only_under_sp and not ctx.sp:
            return grad
        out = grad.contiguous().clone()
        all_reduce(out, group=ctx.group, tag=tag).wait()
        return out

    return [p.register_hook(reduce) for p in params]
