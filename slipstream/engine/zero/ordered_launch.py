"""Launch bucket collectives in a fixed order, whatever order their gradients arrive in.

[Note: buckets launch in index order] gloo and nccl match collectives by issue order, so every
rank must launch the same buckets in the same order even when gradients arrive differently
(data-dependent control flow, parameters unused on some ranks). A complete bucket waits until every
lower-indexed bucket has launched; :meth:`flush` launches whatever is left, in order.

[Note: the last bucket launches at the flush] When the last bucket is complete every gradient of
the window has arrived, so nothing of the backward is left for its collective to overlap with; the
caller's flush comes next and waits for every bucket at once. Launched from the hook it would go
to the ring's thread and come back (~95 µs at 2 ranks, a third of a small model's step); launched
by the flush with ``waited=True`` it may run on the caller's thread where the ring is idle ([Note:
waited-for collectives run inline] in ``comm/ring_collectives.py``). Every other bucket launches
as soon as it and the ones before it are complete.
"""

from __future__ import annotations

from typing import Protocol

from slipstream.errors import UsageError


class Launch(Protocol):
    def __call__(self, index: int, waited: bool) -> None:
        """Launch bucket ``index``; ``waited``: the caller waits for it before it issues anything else."""


class OrderedLauncher:
    def __init__(self, members: list[list[int]], launch: Launch) -> None:
        self.members = members
        self.bucket_of = {i: b for b, ms in enumerate(members) for i in ms}
        self.launch = launch
        self.reset()

    def reset(self) -> None:
        self.pending = [len(ms) for ms in self.members]
        self.ready: set[int] = set()
        self.next = 0

    def mark_ready(self, index: int, launch: bool = True) -> None:
        """Gradient ``index`` is final for this window; launch every bucket that can go."""
        if index in self.ready:
            self.twice(index)
        self.ready.add(index)
        bucket = self.bucket_of[index]
        self.pending[bucket] -= 1
        if launch and not self.pending[bucket]:
            self.complete(bucket)

    def complete(self, bucket: int) -> None:
        """Every gradient of ``bucket`` is final for this window (counted by the caller: ``arrivals.py``)."""
        self.pending[bucket] = 0
        if bucket == self.next:  # only the next bucket can open the way
            self._advance(force=False)

    @staticmethod
    def twice(index: int) -> None:
        raise UsageError(
            f"gradient of parameter #{index} arrived twice in the micro-step that completes an accumulation "
            "window: run one backward pass per micro-step (add the losses and call engine.backward once), "
            "and use non-reentrant activation checkpointing"
        )

    def flush(self) -> None:
        self._advance(force=True)

    def _advance(self, force: bool) -> None:
        last = len(self.members) - 1
        while self.next <= last:
            # [Note: the last bucket launches at the flush]
            if not force and (self.pending[self.next] or self.next == last):
                return
            bucket, self.next = self.next, self.next + 1
            self.launch(bucket, bucket == last)
