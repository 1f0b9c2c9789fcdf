"""A rank's flat partition held as a few separate tensors, addressed in partition coordinates.

[Note: partition coordinates] A rank owns chunk r of every bucket (flat_layout.py); concatenated, the
chunks form its partition, ``shard_numel`` elements long, and every optimizer piece has a
``shard_offset`` in it. Stage 2 keeps its gradients and stage 3 its parameters in exactly these
coordinates, but stage 1's gradients and stages 1/2's parameters are chunks of full-size flat
buffers. ``Chunks`` lets the offload optimizer address all of them alike, without copying them
into one tensor first (on a CPU device a copy would be pure overhead).
"""

from __future__ import annotations

import bisect

import torch


class Chunks:
    """Tensors ``tensors[i]`` covering partition elements ``[offsets[i], offsets[i] + len)``."""

    def __init__(self, offsets: list[int], tensors: list[torch.Tensor]) -> None:
        order = sorted(range(len(offsets)), key=offsets.__getitem__)
        self.offsets = [offsets[i] for i in order]
        self.tensors = [tensors[i] for i in order]

    @classmethod
    def flat(cls, tensor: torch.Tensor, offset: int = 0) -> Chunks:
        return cls([offset], [tensor])

    def slice(self, start: int, numel: int) -> torch.Tensor:
        """Elements ``[start, start + numel)``, which must lie inside one chunk (a piece always does)."""
        i = bisect.bisect_right(self.offsets, start) - 1
        if i < 0:
            raise IndexError(f"partition offset {start} precedes every chunk")
        local = start - self.offsets[i]
        tensor = self.tensors[i]
        if local + numel > tensor.numel():
            raise IndexError(f"partition range [{start}, {start + numel}) crosses a chunk boundary")
        return tensor[local : local + numel]

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device if self.tensors else torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return self.tensors[0].dtype if self.tensors else torch.float32


def overlaps(chunks: Chunks, lo: int, hi: int) -> list[tuple[int, int, torch.Tensor]]:
    """``(start, end, tensor view)`` for every part of ``chunks`` inside ``[lo, hi)``."""
    out = []
    for offset, tensor in zip(chunks.offsets, chunks.tensors):
        begin, end = max(lo, offset), min(hi, offset + tensor.numel())
        if begin < end:
            out.append((begin, end, tensor[begin - offset : end - offset]))
    return out


def copy_out(chunks: Chunks, destination: torch.Tensor, lo: int) -> None:
    """Copy what ``chunks`` hold of ``[lo, lo + len(destination))`` into ``destination`` (casting)."""
    for begin, end, view in overlaps(chunks, lo, lo + destination.numel()):
        destination[begin - lo : end - lo].copy_(view, non_blocking=True)


def copy_in(chunks: Chunks, source: torch.Tensor, lo: int) -> None:
    """Copy ``source`` (covering ``[lo, lo + len)``) into the parts of ``chunks`` it overlaps (casting)."""
    for begin, end, view in overlaps(chunks, lo, lo + source.numel()):
        view.copy_(source[begin - lo : end - lo], non_blocking=True)


def join(parts: list[Chunks]) -> Chunks:
    """One ``Chunks`` over several (disjoint) ones, e.g. the partitions of several sharding groups."""
    return Chunks([o for c in parts for o in c.offsets], [t for c in parts for t in c.tensors])
