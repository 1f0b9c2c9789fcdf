"""Which tokens of a sequence each rank of a context-parallel group holds.

[Note: contiguous and zig-zag] Cut ``s`` tokens into ``c`` contiguous shards and causal attention
is unbalanced: rank 0's queries see only their own shard, rank ``c-1``'s see everything. Zig-zag
cuts ``2c`` chunks and gives rank ``r`` chunks ``r`` and ``2c-1-r`` (one early, one late), so
every rank does the same causal work. Work is counted in (query chunk, key chunk) pairs of equal
chunks: a pair whose keys all precede its queries costs 1, a diagonal pair (the same chunk) 1/2,
a pair whose keys all follow its queries is skipped. At c = 2 contiguous shards cost rank 0 a
diagonal (0.5) and rank 1 a full pair and a diagonal (1.5): ratio 3.0. Zig-zag (chunks 0|3 and
1|2 of four) costs 0.5 + 3.5 = 4 on rank 0 and 1.5 + 2.5 = 4 on rank 1: ratio 1.00.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Layout:
    """``c`` ranks, ``zigzag`` or contiguous; a rank's tokens are its chunks (equal, aligned) in order."""

    size: int
    zigzag: bool

    @property
    def chunks_per_rank(self) -> int:
        return 2 if self.zigzag else 1

    @property
    def divisor(self) -> int:
        """Sequence lengths must divide by this."""
        return self.size * self.chunks_per_rank

    def chunks(self, rank: int) -> list[int]:
        """Global chunk indices of ``rank``'s tokens, in local order."""
        if self.zigzag:
            return [rank, 2 * self.size - 1 - rank]
        return [rank]

    def positions(self, rank: int, length: int) -> torch.Tensor:
        """Global token positions of ``rank``'s tokens (its local order)."""
        chunk = length // self.divisor
        return torch.cat([torch.arange(k * chunk, (k + 1) * chunk) for k in self.chunks(rank)])


def pair_work(layout: Layout, rank: int) -> float:
    """Causal work of ``rank`` in chunk pairs (diagonal = 1/2), against every rank's keys."""
    work = 0.0
    for q in layout.chunks(rank):
        for source in range(layout.size):
            for k in layout.chunks(source):
                work += 1.0 if k < q else 0.5 if k == q else 0.0
    return work
