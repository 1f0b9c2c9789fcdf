"""The communication context: the one owner of communication streams and the events that order them.

Each sharding strategy owns one :class:`CommContext` (FSDP2's ``FSDPCommContext`` is the model).
Every collective the strategy issues goes through it, so the ordering rules live in one place:

* ``issue(kind, launch)``: an event recorded on the compute stream marks that the collective's
  inputs are written (a gradient is reduced only after the backward that wrote it); the traffic
  kind's own stream waits for it, the collective is launched on that stream, and an event is
  recorded there after it;
* ``wait(pending)``: before compute uses what a collective wrote (a gathered unit, a reduced
  gradient), the host waits for the backend and the compute stream waits for the collective's
  event; a send buffer goes back to its pool only after this (it is never reused while the
  collective may still read it);
* ``free(release)``: storage compute has read (a gathered unit) is released after an event on
  the compute stream marks the end of its last use.

One stream per kind of traffic: ``all_gather``, ``reduce_scatter``, ``all_reduce``, ``p2p`` and
``copy`` (host-device copies of offloaded state). On CUDA these are real streams and events from
the accelerator; on CPU the accelerator's stand-ins cost nothing and the backend's own threads run
the collectives, exactly as before. No strategy or collective touches ``torch.cuda``: the
accelerator wraps it, and this context is the only code that creates streams and events
(``tests/unit/test_architecture.py`` checks both).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from slipstream.accelerator import Accelerator, get_accelerator

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "p2p", "copy")


class Pending:
    """An issued collective (or copy): the backend's handle and the event recorded after it on its stream."""

    def __init__(self, context: CommContext, kind: str, tag: str, work: Any, done: Any) -> None:
        self.context, self.kind, self.tag, self.work, self.done = context, kind, tag, work, done
        self.waited = False

    def wait(self) -> None:
        self.context.wait(self)

    def ready(self) -> bool:
        """Whether waiting would not block: the collective completed and its stream passed the event."""
        finished = self.work is None or self.work.is_completed()
        return self.waited or (finished and self.done.query())


class CommContext:
    def __init__(self, accelerator: Accelerator | None = None) -> None:
        self.accelerator = accelerator if accelerator is not None else get_accelerator()
        self.streams: dict[str, Any] = {}
        self.last_use: Any = None  # the end of compute's last read of freed storage (the next gather waits for it)
        # Called with (what, kind, tag) at each step below: "launch", "wait", "free", "recycle" (tests pin the order).
        self.observer: Callable[[str, str, str], None] | None = None

    def _note(self, what: str, kind: str, tag: str) -> None:
        if self.observer is not None:
            self.observer(what, kind, tag)

    def stream(self, kind: str) -> Any:
        """The stream of one kind of traffic, made on first use."""
        if kind not in KINDS:
            raise ValueError(f"communication context: unknown traffic kind {kind!r} (one of {', '.join(KINDS)})")
        if kind not in self.streams:
            self.streams[kind] = self.accelerator.new_stream()
        return self.streams[kind]

    def issue(self, kind: str, launch: Callable[[], Any], tag: str = "") -> Pending:
        """Launch ``launch()`` on ``kind``'s stream once the compute stream's work so far is done."""
        acc = self.accelerator
        inputs_ready = acc.new_event()
        inputs_ready.record(acc.current_stream())
        stream = self.stream(kind)
        if kind == "all_gather" and self.last_use is not None:
            stream.wait_event(self.last_use)  # storage freed since may be refilled: not before its readers finished
        stream.wait_event(inputs_ready)
        with acc.stream(stream):
            self._note("launch", kind, tag)
            work = launch()
            done = acc.new_event()
            done.record(stream)
        return Pending(self, kind, tag, work, done)

    def wait(self, pending: Pending) -> None:
        """Make what ``pending`` wrote usable by compute (once; later calls return at once)."""
        if pending.waited:
            return
        if pending.work is not None:
            pending.work.wait()
        self.accelerator.current_stream().wait_event(pending.done)
        pending.waited = True
        self._note("wait", pending.kind, pending.tag)

    def wait_host(self, pending: Pending) -> None:
        """Before the host reads what ``pending`` wrote (a copy to host memory the CPU optimizer steps on)."""
        if pending.work is not None:
            pending.work.wait()
        pending.done.synchronize()
        pending.waited = True
        self._note("wait", pending.kind, pending.tag)

    def free(self, release: Callable[[], None], tag: str = "") -> None:
        """Release storage after the compute that reads it: an event on the compute stream, then ``release()``."""
        used = self.accelerator.new_event()
        used.record(self.accelerator.current_stream())
        self.last_use = used
        self._note("free", "compute", tag)
        release()

    def recycle(self, pending: Pending, put_back: Callable[[], None]) -> None:
        """Return a send buffer to its pool: only once the collective reading it is complete."""
        self.wait(pending)
        self._note("recycle", pending.kind, pending.tag)
        put_back()
