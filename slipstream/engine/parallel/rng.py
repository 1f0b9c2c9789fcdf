"""Dropout randomness under tensor parallelism: replicated regions alike on every tp rank, sharded ones not.

[Note: two streams] Between a row layer and the next column layer every tp rank computes the same
activations, so their dropout masks must be the same: the default generator is made identical over
the tp group at ``initialize`` (tp rank 0's state). Between a sub-block's column layers and its row
layer each rank holds different heads or MLP columns, and their masks must be independent (else
head 0's mask on rank 0 equals head 2's on rank 1). On entering such a region a seed is drawn from
the (replicated) default stream, the generator is re-seeded with that seed and the tp rank, and on
leaving the default state after the draw is restored.

[Note: one stream per slice] Pipeline stages hold different layers and Ulysses / ring ranks
different positions of one sequence; in one process every one of them draws fresh dropout masks.
Seeded alike (the usual ``torch.manual_seed(s)`` on every rank), stage 1's first block would draw
the masks stage 0's first block drew, and sequence shard 1 the masks of shard 0: correlated
dropout that no loss comparison at dropout 0 would show. So at ``initialize`` every rank's
default generator is re-seeded from a draw of its own stream mixed with its pp, cp and sp
coordinates (the first stage's first shard keeps its stream, so a mesh without pp, cp or sp
changes nothing). tp ranks keep one stream (same coordinates, same synced state) and data-parallel
ranks keep the user's seeding, as DDP would.

Activation checkpointing needs no extra state: recomputation restores the default generator to
where the forward began, so it draws the same seeds and re-creates the same masks (Megatron keeps a
tracker of named states and saves it with each checkpoint for the same reason).

A compiled block draws its random numbers from one seed per graph, so the fork cannot happen inside
it: compiling with tensor parallelism is refused while the model has dropout (parallel/compiling.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from slipstream import comm
from slipstream.accelerator import get_accelerator

_PRIME = 1_000_003


def sync_default_rng(group: dist.ProcessGroup, root: int) -> None:
    """Give every rank of ``group`` the default (CPU and device) generator state of global rank ``root``. Collective."""
    accelerator = get_accelerator()
    state = torch.get_rng_state()
    comm.broadcast(state, src=root, group=group, tag="default generator state").wait()
    torch.set_rng_state(state)
    device_state = accelerator.rng_state()
    if device_state is not None:
        moved = device_state.to(accelerator.device()) if dist.get_backend(group) == "nccl" else device_state
        comm.broadcast(moved, src=root, group=group, tag="device generator state").wait()
        accelerator.set_rng_state(moved.cpu())


def separate_slices(pp: int, cp: int, sp: int) -> None:
    """Re-seed the default generator for this rank's pipeline stage and sequence shard ([Note: one stream per slice])."""
    if pp == cp == sp == 0:
        return
    seed = int(torch.randint(0, 2**62, (1,)))  # alike on every rank seeded alike, and on every tp rank (synced)
    for coordinate in (pp, cp, sp):
        seed = (seed * _PRIME + 7919 + coordinate) % 2**63
    get_accelerator().manual_seed(seed)


class ShardedRegionRng:
    """Enter/leave a sharded region (see [Note: two streams]); re-entering while inside is a no-op."""

    def __init__(self, tp_rank: int) -> None:
        self.tp_rank = tp_rank
        self._saved: tuple[torch.Tensor, torch.Tensor | None] | None = None

    @property
    def inside(self) -> bool:
        return self._saved is not None

    def enter(self) -> None:
        if self._saved is not None or torch.compiler.is_compiling():  # compiled: refused with dropout (compiling.py)
            return
        accelerator = get_accelerator()
        seed = int(torch.randint(0, 2**31 - 1, (1,)))  # the same on every tp rank: the stream is replicated
        self._saved = (torch.get_rng_state(), accelerator.rng_state())
        accelerator.manual_seed((seed * _PRIME + 2718 + self.tp_rank) % 2**63)

    def leave(self) -> None:
        if self._saved is None or torch.compiler.is_compiling():
            return
        cpu, device = self._saved
        self._saved = None
        torch.set_rng_state(cpu)
        if device is not None:
            get_accelerator().set_rng_state(device)
