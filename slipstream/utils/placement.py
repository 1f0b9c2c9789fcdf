"""Where a rank's local piece of a parameter sits in the model's global tensor.

[Note: why a placement] Tensor, pipeline and expert parallelism leave each rank holding a *piece*
of the model: a column block of a weight (tp), a range of experts out of a fused 3-D weight (ep),
or only some layers (pp). ZeRO then flattens and shards whatever a rank holds. Two things must
still see the global model: checkpoints (a tp 2 checkpoint loads at tp 1) and the gradient norm
(each element counted once). The parallelism that cuts a parameter records here its global shape
and the offsets of the local piece (``place``); the ZeRO strategies read it back
(``placement_of``) when they describe their slices, without importing the parallelism (the
``parallel`` and ``zero`` packages never import each other: this module sits below both).

A piece held identically by several ranks outside their ZeRO sharding group (a LayerNorm weight
on every tp rank, a tied embedding on the first and last pipeline stage) is marked ``duplicate``
on all but one of them: that copy is neither saved in a checkpoint nor counted in the norm.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from slipstream.utils.pieces import Box


@dataclasses.dataclass(frozen=True)
class Placement:
    """The local piece = ``global[offsets[d] : offsets[d] + local_shape[d]]`` along every dimension ``d``.

    [Note: packed pieces] A packed projection (GPT-2's ``c_attn`` = Q|K|V) cut per part leaves a
    rank one box per part. Such a piece is stored part-major, so its flattened elements are the
    boxes' flattened elements one box after another, and ``boxes`` lists them in that order (then
    ``offsets`` is unused). A flat range of the piece is then a flat range inside one or more boxes.
    """

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    duplicate: bool = False  # another rank holds the same piece and is the one that saves and counts it
    boxes: tuple[Box, ...] | None = None

    def box(self, local_shape: tuple[int, ...]) -> Box | None:
        """``(offsets, sizes)`` within the global tensor; None when the piece is the whole tensor (or packed: see ``boxes``)."""
        if self.boxes is not None:
            return None
        if tuple(local_shape) == self.global_shape and not any(self.offsets):
            return None
        return self.offsets, tuple(local_shape)


# Kept on the tensor itself: a WeakKeyDictionary would compare tensors with ``==``, and an id-keyed
# table would outlive (and be confused by) freed parameters.
_ATTRIBUTE = "_slipstream_placement"


def place(
    param: torch.Tensor,
    global_shape: tuple[int, ...] | torch.Size,
    offsets: tuple[int, ...] | None = None,
    *,
    duplicate: bool = False,
) -> Placement:
    """Record that ``param`` is the piece at ``offsets`` (default: the origin) of a tensor of ``global_shape``."""
    global_shape = tuple(int(s) for s in global_shape)
    offsets = tuple(int(o) for o in offsets) if offsets is not None else (0,) * len(global_shape)
    local = tuple(param.shape)
    if len(offsets) != len(global_shape) or len(local) != len(global_shape):
        raise ValueError(f"place: rank mismatch: local shape {local}, global shape {global_shape}, offsets {offsets}")
    for d, (o, n, g) in enumerate(zip(offsets, local, global_shape)):
        if o < 0 or o + n > g:
            raise ValueError(f"place: dimension {d}: piece [{o}, {o + n}) does not fit in global size {g}")
    placement = Placement(global_shape, offsets, duplicate)
    setattr(param, _ATTRIBUTE, placement)
    return placement


def place_parts(
    param: torch.Tensor, global_shape: tuple[int, ...] | torch.Size, boxes: list[Box], *, duplicate: bool = False
) -> Placement:
    """Record that ``param`` holds, flattened, the elements of ``boxes`` of a ``global_shape`` tensor one after another."""
    global_shape = tuple(int(s) for s in global_shape)
    boxes_t = tuple((tuple(int(o) for o in off), tuple(int(n) for n in sizes)) for off, sizes in boxes)
    total = 0
    for off, sizes in boxes_t:
        if len(off) != len(global_shape) or len(sizes) != len(global_shape):
            raise ValueError(f"place_parts: box {off}+{sizes} does not match the global shape {global_shape}")
        for d, (o, n, g) in enumerate(zip(off, sizes, global_shape)):
            if o < 0 or o + n > g:
                raise ValueError(f"place_parts: dimension {d}: box [{o}, {o + n}) does not fit in global size {g}")
        total += math.prod(sizes)
    if total != param.numel():
        raise ValueError(f"place_parts: the boxes hold {total} elements, the parameter {param.numel()}")
    placement = Placement(global_shape, (0,) * len(global_shape), duplicate, boxes_t)
    setattr(param, _ATTRIBUTE, placement)
    return placement


def parts_of(param: torch.Tensor) -> list[tuple[int, Box]] | None:
    """A packed piece's boxes with the flat offset at which each starts in ``param``; None for a one-box piece."""
    placement = getattr(param, _ATTRIBUTE, None)
    if placement is None or placement.boxes is None:
        return None
    parts, start = [], 0
    for box in placement.boxes:
        parts.append((start, box))
        start += math.prod(box[1])
    return parts


def placement_of(param: torch.Tensor) -> Placement | None:
    """The recorded placement of ``param``; None for a parameter no parallelism has cut (the whole tensor)."""
    return getattr(param, _ATTRIBUTE, None)


def global_shape_and_box(param: torch.Tensor) -> tuple[tuple[int, ...], Box | None]:
    """What a checkpoint slice of ``param`` records: its global shape and its box (None: whole)."""
    placement = getattr(param, _ATTRIBUTE, None)
    if placement is None:
        return tuple(param.shape), None
    return placement.global_shape, placement.box(tuple(param.shape))


def is_duplicate(param: torch.Tensor) -> bool:
    """True where another rank saves (and counts in the norm) the same piece of ``param``."""
    placement = getattr(param, _ATTRIBUTE, None)
    return placement is not None and placement.duplicate
