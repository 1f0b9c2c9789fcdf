"""What a strategy hands the checkpoint code: its share of every parameter, by name and flat offset.

[Note: slices, not ranks] ZeRO stores a parameter's elements in flat buffers cut by rank (stage
1/2 buckets, stage 3 units), so a rank owns contiguous ranges of the *flattened* parameter. A
checkpoint that records each range as (parameter name, flat start, length) together with the
parameter's shape can be reassembled by any other world size or stage: the reader simply asks for
the ranges it owns now. The optimizer's per-parameter tensors (Adam's moments) have the same
ranges, because the optimizer steps exactly these slices.

[Note: boxes] Tensor parallelism cuts a parameter into boxes (offsets and sizes along each
dimension) before ZeRO flattens what a rank holds. So a slice is a flat range *inside a box* of the
global tensor; ZeRO alone is the case "box = the whole tensor", the default. The slice type itself,
``ParamSlice``, lives in ``utils/pieces.py`` ([Note: a piece of a global tensor]).
"""

from __future__ import annotations

import dataclasses

import torch

from slipstream.utils.pieces import ParamSlice
from slipstream.utils.placement import global_shape_and_box, parts_of


@dataclasses.dataclass
class OwnedSlice:
    """One slice as this rank holds it.

    ``value`` is a 1-D view of the fp32 master (trainable parameters) or of the parameter itself
    (frozen ones, or strategies without masters); writing into it and calling the strategy's
    ``refresh_from_masters`` makes the model see the new weights. ``optimizer_param`` is the tensor
    the optimizer steps for this slice (the key of ``optimizer.state``), ``None`` for frozen ones.
    ``replicated`` slices exist whole on every rank of the strategy's group (every rank loads them).
    ``duplicate`` slices are saved by another rank (a replica of a replicated slice, another
    subgroup's copy, a piece ``utils/placement.py`` marks duplicate): this rank neither saves them
    nor counts them in the gradient norm, so a checkpoint and the norm hold each element once.
    """

    slice: ParamSlice
    value: torch.Tensor
    optimizer_param: torch.Tensor | None
    replicated: bool = False
    duplicate: bool = False


def slice_of(name: str, param: torch.Tensor, start: int = 0, numel: int | None = None) -> ParamSlice:
    """Elements ``[start, start + numel)`` of ``param`` as a slice of its global tensor (its placement's box)."""
    shape, box = global_shape_and_box(param)
    parts = parts_of(param)
    numel = param.numel() if numel is None else numel
    if parts is not None:
        return ParamSlice(name, shape, start, numel, None, tuple(parts))
    return ParamSlice(name, shape, start, numel, box)
