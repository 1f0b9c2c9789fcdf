"""Where each parameter's elements lie in DeepSpeed's flat fp32 partitions, rank by rank.

[Note: ZeRO 1/2 versus ZeRO 3 partitions] At ZeRO 1 and 2 a parameter group is flattened into one
vector (parameters in ``param_shapes`` order, each followed by its alignment padding), padded at
the end to a multiple of the world size and cut into equal partitions: rank ``r`` holds
``[r·P, (r+1)·P)``, and a partition may begin or end inside a parameter. The saved partition drops
the rank's end padding (``group_paddings``). At ZeRO 3 every parameter is cut on its own into
``ceil(n / world)`` elements per rank (the last rank's share padded), and a rank's flat group is its
shares of the group's parameters one after another. Either way each rank's share of a parameter is
one flat range ``[start, start + numel)`` of the flattened parameter: exactly a slipstream slice,
so the converted checkpoint reshards to any world size and stage like one of ours.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Share:
    """A rank's elements ``[start, start + numel)`` of parameter ``name``, at ``offset`` in the rank's flat vector."""

    name: str
    shape: tuple[int, ...]
    start: int
    numel: int
    offset: int


def zero12_shares(
    shapes: dict[str, tuple[int, ...]], paddings: list[int] | None, rank: int, partition: int, held: int
) -> list[Share]:
    """The shares of one group's partition ``rank``: ``partition`` elements per rank with padding, ``held`` saved."""
    if paddings is not None and len(paddings) != len(shapes):
        raise ValueError(f"{len(paddings)} alignment paddings for {len(shapes)} parameters")
    begin, end = rank * partition, rank * partition + held
    shares, at = [], 0
    for i, (name, shape) in enumerate(shapes.items()):
        n = math.prod(shape)
        lo, hi = max(at, begin), min(at + n, end)
        if lo < hi:
            shares.append(Share(name, shape, lo - at, hi - lo, lo - begin))
        at += n + (paddings[i] if paddings is not None else 0)
    return shares


def zero12_total(shapes: dict[str, tuple[int, ...]], paddings: list[int] | None) -> int:
    """Elements of the unpadded flat group (parameters and their alignment paddings)."""
    return sum(math.prod(s) for s in shapes.values()) + (sum(paddings) if paddings is not None else 0)


def zero3_shares(shapes: dict[str, tuple[int, ...]], rank: int, world: int) -> tuple[list[Share], int]:
    """The shares of rank ``rank`` over parameters ``shapes`` (every group, in order) and its flat length."""
    shares, offset = [], 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        per_rank = math.ceil(n / world)
        lo, hi = min(rank * per_rank, n), min((rank + 1) * per_rank, n)
        if hi > lo:
            shares.append(Share(name, shape, lo, hi - lo, offset))
        offset += per_rank
    return shares, offset
