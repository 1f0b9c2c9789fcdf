"""Resident buffers that ZeRO-3's gathered units and reduce-scatter send buffers borrow and hand back.

[Note: gathered units borrow resident buffers]
A unit's parameters are views into its flat storage ([Note: freeing without rebinding] in
``unit.py``). Releasing the unit used to ``resize_(0)`` that storage and gathering it again to
``resize_`` it back: a fresh allocation per gather. On a GPU the caching allocator hands the same
block back; on the host, glibc does not. Kept below the mmap threshold, freed units left holes in
the heap that the next unit did not fit (265 MB mapped after 24 units); above it, every gather
mapped fresh pages and faulted them in: measured on gpt2-large at 2 ranks without huge pages
(plain ``torchrun``), ~7 ms per 12.6 MB unit, 17 gathers a step, 1.06x DDP's step time. The
reduce-scatter's send buffers kept their own pool (two per size) to avoid the same faults, idle at
the start of backward, the step's peak.

Now one pool serves both. Gathering a unit takes a resident buffer of its size (or a little more)
and moves it into the unit's storage by swapping the two storages' data pointers
(``UntypedStorage._swap_data_ptr_``): the parameters and every tensor autograd saved from them
keep pointing at the same storage, which now owns memory that was faulted in once. Releasing the
unit swaps the memory back out into the pool. A unit's backward releases it just before its
gradients are copied into a send buffer of the same size, so the reduce-scatter sends from the
buffer the unit just gave back: no buffer is held for sending alone.

The pool sizes itself: it never owns more than the most bytes the schedule had borrowed at once
(the running unit, the one gathered ahead, a send buffer in flight, the root; 55 MB on that
model), and what would exceed that is freed, the buffer idle longest first. So after the first
step it allocates nothing, and it never holds a model's worth: a model of many unit sizes keeps
the few buffers its schedule uses, not one per size. Gathering every unit at once (an
accumulation window, a checkpoint) is not a schedule to remember: ``shrink`` frees what it left.
Without ``_swap_data_ptr_`` (an older torch) gathering resizes the storage as before.

[Note: nothing idle into the backward] The step's peak is the end of the forward or the start of
backward, when every activation is alive. A pooled buffer idle then is memory no activation can
use (on a GPU the caching allocator would hand it to them; glibc cannot), so once a forward that a
backward follows has started its last gather (the pre-hook of its last block), the idle ones are
freed: measured on gpt2-large at 2 ranks, two 12.6 MB buffers, whose pages the backward then
faults in again (~1% of the step) for 25 MB less at the peak. Not at the end of the model's
forward, as before: the last block, the head and the loss (a vocabulary's logits) run before it
and make the peak there; on a 16-block GPT-2 the buffers idle then (7 MiB) had been a fifth of
what stage 3 held beyond its shard at its peak.
"""

from __future__ import annotations

import torch

_CAN_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")
SLACK = 4  # a pooled buffer serves a request up to 1/SLACK smaller than itself


class UnitBuffers:
    """Idle resident buffers; gathered units and send buffers take them and hand them back."""

    def __init__(self) -> None:
        self.idle: list[torch.UntypedStorage] = []  # longest idle first
        self.lent = 0  # bytes taken and not yet handed back
        self.most_lent = 0  # the most bytes ever lent at once: what the pool may own
        self.fresh = 0  # buffers allocated because none idle fitted (a steady state allocates none)

    def _pop(self, nbytes: int, device: torch.device) -> torch.UntypedStorage:
        fits = [s for s in self.idle if nbytes <= s.nbytes() <= nbytes + nbytes // SLACK and s.device == device]
        if fits:
            storage = min(fits, key=lambda s: s.nbytes())
            self.idle.remove(storage)
        else:
            self.fresh += 1
            storage = torch.empty(nbytes, dtype=torch.uint8, device=device).untyped_storage()
        self.lent += storage.nbytes()
        self.most_lent = max(self.most_lent, self.lent)
        return storage

    def _push(self, storage: torch.UntypedStorage) -> None:
        self.lent -= storage.nbytes()
        self.idle.append(storage)
        while self.idle and self.lent + self.held_bytes() > self.most_lent:
            self.idle.pop(0)  # back to the allocator: the buffer idle longest

    def shrink(self) -> None:
        """Free every idle buffer and forget the high-water mark (after gathering every unit at once)."""
        self.idle.clear()
        self.most_lent = self.lent

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give an empty ``storage`` at least ``nbytes`` of memory (its contents are undefined)."""
        if not _CAN_SWAP:
            storage.resize_(nbytes)
            return
        storage._swap_data_ptr_(self._pop(nbytes, storage.device))

    def empty(self, storage: torch.UntypedStorage) -> None:
        """Take ``storage``'s memory back (it holds zero bytes afterwards); views of it stay valid to refill."""
        if not _CAN_SWAP:
            storage.resize_(0)
            return
        if storage.nbytes() == 0:
            return
        holder = torch.UntypedStorage(0, device=storage.device)
        holder._swap_data_ptr_(storage)
        self._push(holder)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat tensor of ``numel`` elements over a pooled buffer (a send buffer; contents undefined)."""
        storage = self._pop(numel * dtype.itemsize, device)
        return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, (numel,))

    def give(self, tensor: torch.Tensor) -> None:
        """Hand back a tensor from ``take`` once nothing reads or writes it any more."""
        self._push(tensor.untyped_storage())

    def held_bytes(self) -> int:
        return sum(s.nbytes() for s in self.idle)
