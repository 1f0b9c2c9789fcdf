"""Launch bucket collectives in a fixed order, whatever order their gradients arrive in.

[Note: buckets launch in index order] gloo and nccl match collectives by issue order, so every
rank must launch the same buckets in the same order even when gradients arrive differently
(data-dependent control flow, parameters unused on some ranks). A complete bucket waits until every
lower-indexed bucket has launched; :meth:`flush` launches whatever is left, in order.
"""

from __future__ import annotations

from collections.abc import Callable

from slipstream.errors import UsageError


class OrderedLauncher:
    def __init__(self, members: list[list[int]], launch: Callable[[int], None]) -> None:
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
            raise UsageError(
                f"gradient of parameter #{index} arrived twice in the micro-step that completes an accumulation "
                "window: run one backward pass per micro-step (add the losses and call engine.backward once), "
                "and use non-reentrant activation checkpointing"
            )
        self.ready.add(index)
        bucket = self.bucket_of[index]
        self.pending[bucket] -= 1
        if launch and bucket == self.next and not self.pending[bucket]:  # only the next bucket can open the way
            self._advance(force=False)

    def flush(self) -> None:
        self._advance(force=True)

    def _advance(self, force: bool) -> None:
        while self.next < len(self.members):
            if self.pending[self.next] and not force:
                return
            bucket, self.next = self.next, self.next + 1
            self.launch(bucket)
