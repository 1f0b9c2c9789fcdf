"""Where every trainable parameter lives in the flat, bucketed, partitioned buffers of ZeRO-1/2.

[Note: partition per bucket] The flat buffer is a sequence of buckets (parameters in reverse
registration order, whatever their optimizer group). Each bucket is padded to a multiple of the
world size and cut into equal chunks: rank r owns chunk r of *every* bucket. A bucket's gradients
then reduce-scatter straight into each owner's chunk and its updated weights all-gather back, one
collective per bucket, while backward is still producing later buckets. A rank's partition is the
concatenation of its chunks; a parameter owned by several ranks is split into *pieces*, and the
optimizer steps one piece per (parameter, rank) pair, so elementwise optimizers reproduce an
unpartitioned run exactly, including skipping parameters that received no gradient.
"""

from __future__ import annotations

import dataclasses

import torch

ALIGN = 8  # elements per chunk boundary: keeps vector loads aligned in every precision


@dataclasses.dataclass
class Slot:
    """One parameter's place in the flat buffer."""

    index: int  # position in the strategy's trainable list
    bucket: int
    start: int  # absolute offset in the flat buffer
    numel: int


@dataclasses.dataclass
class Piece:
    """The part of one parameter that this rank owns and updates."""

    index: int  # parameter index
    param_offset: int  # where the piece starts inside the parameter (flattened)
    shard_offset: int  # where it starts inside this rank's concatenated partition
    numel: int


@dataclasses.dataclass
class LayoutBucket:
    index: int
    start: int
    numel: int  # padded
    chunk: int  # numel // world
    members: list[int]
    shard_offset: int = 0  # where this bucket's chunk starts in the concatenated partition

    def chunk_range(self, rank: int) -> tuple[int, int]:
        begin = self.start + rank * self.chunk
        return begin, begin + self.chunk


class FlatLayout:
    """Buckets, padding, chunks and this rank's pieces for ``params`` split into optimizer ``groups``."""

    def __init__(
        self,
        numels: list[int],
        groups: list[list[int]],
        bucket_numel: int,
        world: int,
        rank: int,
        buckets: list[list[int]] | None = None,
    ) -> None:
        """``buckets`` fixes the bucket members explicitly (ZeRO-3: one bucket per unit)."""
        self.world, self.rank = world, rank
        self.slots: list[Slot | None] = [None] * len(numels)
        self.buckets: list[LayoutBucket] = []
        offset = 0
        if buckets is None:
            buckets = self._by_size(numels, groups, bucket_numel)
        for members in buckets:
            offset = self._close(members, numels, offset)
        self.numel = offset
        self.shard_numel = sum(b.chunk for b in self.buckets)
        self.pieces = self._pieces()

    @staticmethod
    def _by_size(numels: list[int], groups: list[list[int]], bucket_numel: int) -> list[list[int]]:
        # Reverse registration order, the order backward usually produces gradients, so early buckets
        # fill first. Buckets ignore optimizer groups: the optimizer sees per-parameter pieces.
        buckets: list[list[int]] = []
        members: list[int] = []
        size = 0
        for i in sorted({i for group in groups for i in group}, reverse=True):
            if members and size + numels[i] > bucket_numel:
                buckets.append(members)
                members, size = [], 0
            members.append(i)
            size += numels[i]
        if members:
            buckets.append(members)
        return buckets

    def _close(self, members: list[int], numels: list[int], offset: int) -> int:
        quantum = self.world * ALIGN
        size = sum(numels[i] for i in members)
        padded = -(-size // quantum) * quantum
        bucket = LayoutBucket(len(self.buckets), offset, padded, padded // self.world, list(members))
        bucket.shard_offset = sum(b.chunk for b in self.buckets)
        position = offset
        for i in members:
            self.slots[i] = Slot(i, bucket.index, position, numels[i])
            position += numels[i]
        self.buckets.append(bucket)
        return offset + padded

    def _pieces(self) -> list[Piece]:
        pieces = []
        for bucket in self.buckets:
            lo, hi = bucket.chunk_range(self.rank)
            for i in bucket.members:
                slot = self.slots[i]
                assert slot is not None
                begin, end = max(lo, slot.start), min(hi, slot.start + slot.numel)
                if begin < end:
                    pieces.append(Piece(i, begin - slot.start, bucket.shard_offset + begin - lo, end - begin))
        return pieces

    def param_view(self, flat: torch.Tensor, index: int, shape: torch.Size) -> torch.Tensor:
        slot = self.slots[index]
        assert slot is not None
        return flat[slot.start : slot.start + slot.numel].view(shape)

    def bucket_view(self, flat: torch.Tensor, bucket: LayoutBucket) -> torch.Tensor:
        return flat[bucket.start : bucket.start + bucket.numel]

    def own_chunk(self, flat: torch.Tensor, bucket: LayoutBucket) -> torch.Tensor:
        lo, hi = bucket.chunk_range(self.rank)
        return flat[lo:hi]

    def shard_chunk(self, shard: torch.Tensor, bucket: LayoutBucket) -> torch.Tensor:
        return shard[bucket.shard_offset : bucket.shard_offset + bucket.chunk]
