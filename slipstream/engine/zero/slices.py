"""What a strategy hands the checkpoint code: its share of every parameter, by name and flat offset.

[Note: slices, not ranks] ZeRO stores a parameter's elements in flat buffers cut by rank (stage
1/2 buckets, stage 3 units), so a rank owns contiguous ranges of the *flattened* parameter. A
checkpoint that records each range as (parameter name, flat start, length) together with the
parameter's shape can be reassembled by any other world size or stage: the reader simply asks for
the ranges it owns now. The optimizer's per-parameter tensors (Adam's moments) have the same
ranges, because the optimizer steps exactly these slices.

[Note: boxes] Tensor parallelism cuts a parameter into boxes (offsets and sizes along each
dimension) before ZeRO flattens what a rank holds. So a slice is a flat range *inside a box* of the
global tensor; ZeRO alone is the case "box = the whole tensor", the default.
"""

from __future__ import annotations

import dataclasses

import torch

from slipstream.utils.placement import global_shape_and_box, parts_of


@dataclasses.dataclass(frozen=True)
class ParamSlice:
    """Elements ``[start, start + numel)`` of the flattened ``box`` of the parameter ``name`` of global shape ``shape``.

    ``box`` is ``(offsets, sizes)`` within the global tensor; ``None`` means the whole tensor.
    ``parts``: a packed piece (utils/placement.py, [Note: packed pieces]) is several boxes laid end
    to end, given as ``(flat start in the piece, box)``; then ``start`` counts in the piece and
    :meth:`split` gives the one-box slices a checkpoint stores.
    """

    name: str
    shape: tuple[int, ...]
    start: int
    numel: int
    box: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    parts: tuple[tuple[int, tuple[tuple[int, ...], tuple[int, ...]]], ...] | None = None

    def split(self) -> list[tuple[int, int, ParamSlice]]:
        """``(lo, hi, one-box slice)``: elements ``[lo, hi)`` of this slice are that slice (itself when one box)."""
        if self.parts is None:
            return [(0, self.numel, self)]
        found = []
        end = self.start + self.numel
        for begin, box in self.parts:
            size = 1
            for n in box[1]:
                size *= n
            lo, hi = max(self.start, begin), min(end, begin + size)
            if lo < hi:
                found.append(
                    (lo - self.start, hi - self.start, ParamSlice(self.name, self.shape, lo - begin, hi - lo, box))
                )
        return found

    @property
    def offsets(self) -> tuple[int, ...]:
        return self.box[0] if self.box is not None else (0,) * len(self.shape)

    @property
    def sizes(self) -> tuple[int, ...]:
        return self.box[1] if self.box is not None else tuple(self.shape)

    @property
    def whole(self) -> bool:
        """True when the box is the whole tensor (every ZeRO-only slice)."""
        if self.parts is not None:
            return False
        return self.box is None or (all(o == 0 for o in self.box[0]) and tuple(self.box[1]) == tuple(self.shape))


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
