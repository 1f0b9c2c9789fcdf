"""A barrier between the ranks of one host through named pipes: a wake-up in microseconds, not a gloo round trip.

[Note: a barrier of pipes] The shared-memory collectives (``shm.py``) meet at one barrier per piece. Through
gloo (``dist.barrier`` on the ring's group) that barrier is a small all-reduce over loopback sockets, handed
to gloo's worker thread and back: measured on the 2-core dev machine at 2 ranks, ~0.5 ms, and it was the whole
cost of a small collective (a 720-float reduce-scatter 1.0 ms, gloo's all-reduce of it 0.6 ms). A step of a model
with few tensors is a few small collectives, so at 10 tensors ZeRO-1 ran at 2.9× DDP's step (issue 50).

Here every ordered pair of ranks has a FIFO in ``/dev/shm``. Arriving, a rank writes one byte to each peer's pipe;
it leaves when it has read one byte from each peer. Each pipe has one writer, so the k-th byte read from it is
that peer's k-th arrival, and a rank leaves barrier k only when every peer has reached barrier k (one pipe per
pair, not one per rank: with a shared pipe a fast peer's byte for barrier k+1 could stand in for a slow peer's
byte for barrier k). The kernel's pipe orders memory: what a peer wrote to its shared file before its byte is
visible after the byte is read, on any architecture. A rank is at most one barrier ahead of any peer, so a
pipe never holds more than two bytes and a write never blocks.

Waiting is ``poll`` on the pipe, in slices of a second so that an abort or a closed ring is seen; the wait
ends when the byte arrives, whatever the slice. It fails, naming the peer, when:

* the peer's write end is closed (end of file): the peer exited, or failed and aborted (``abort.py`` closes
  this process's write ends with its groups, so its peers stop at once instead of at the timeout);
* ``comms_timeout_seconds`` passes.

The pipes are made and opened collectively with the shared files and unlinked once every rank holds them, so
a killed job leaves none behind. The read end is opened first (non-blocking: it must not wait for a writer),
the write ends after every rank has made its pipes; once open the read end is switched to blocking reads.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time

from slipstream.comm.distributed import current_timeout

_SLICE_S = 1.0  # how often a waiting rank looks at whether its ring was aborted or closed


class HostBarrierError(RuntimeError):
    """A peer did not arrive: it closed its pipe (exited or failed) or the timeout passed."""


def pipe_path(prefix: str, source: int, target: int) -> str:
    """The FIFO ``source`` writes to and ``target`` reads from."""
    return os.path.join("/dev/shm", f"slipstream-{prefix}-pipe-{source}-{target}")


def make_incoming(prefix: str, rank: int, size: int) -> dict[int, int] | None:
    """Make and open (read end) the pipes every peer writes to this rank; None if the filesystem cannot."""
    opened: dict[int, int] = {}
    try:
        for peer in range(size):
            if peer != rank:
                path = pipe_path(prefix, peer, rank)
                os.mkfifo(path, 0o600)
                opened[peer] = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        close_all(opened)
        unlink_incoming(prefix, rank, size)
        return None
    for fd in opened.values():
        os.set_blocking(fd, True)
    return opened


def open_outgoing(prefix: str, rank: int, size: int) -> dict[int, int] | None:
    """Open (write end) the pipe to every peer, which each peer made and holds open for reading; None on failure."""
    opened: dict[int, int] = {}
    try:
        for peer in range(size):
            if peer != rank:
                fd = os.open(pipe_path(prefix, rank, peer), os.O_WRONLY | os.O_NONBLOCK)
                os.set_blocking(fd, True)
                opened[peer] = fd
    except OSError:
        close_all(opened)
        return None
    return opened


def unlink_incoming(prefix: str, rank: int, size: int) -> None:
    for peer in range(size):
        if peer != rank:
            with contextlib.suppress(OSError):
                os.unlink(pipe_path(prefix, peer, rank))


def close_all(fds: dict[int, int]) -> None:
    for fd in fds.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


class HostBarrier:
    """The pipes of one ring's ranks (see [Note: a barrier of pipes])."""

    def __init__(self, incoming: dict[int, int], outgoing: dict[int, int]) -> None:
        self.incoming, self.outgoing = incoming, outgoing
        self.stopped: str | None = None  # why later waits fail at once (abort, close)
        self._polls = {}
        for peer, fd in incoming.items():
            self._polls[peer] = select.poll()
            self._polls[peer].register(fd, select.POLLIN)
        # Writes and closes of the write ends never overlap: a descriptor closed under a write could be reused.
        self._writing = threading.Lock()

    def wait(self) -> None:
        """Arrive and leave once every peer has arrived. Raises :class:`HostBarrierError` naming the peer."""
        with self._writing:
            if self.stopped is not None:
                raise HostBarrierError(f"same-host barrier not entered: {self.stopped}")
            for peer, fd in self.outgoing.items():
                try:
                    os.write(fd, b"\x01")
                except OSError as err:
                    raise HostBarrierError(f"same-host barrier: rank {peer}'s pipe is closed ({err})") from err
        limit = current_timeout().total_seconds()
        for peer, fd in self.incoming.items():
            self._read_one(peer, fd, limit)

    def _read_one(self, peer: int, fd: int, limit: float) -> None:
        deadline = time.monotonic() + limit
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise HostBarrierError(f"same-host barrier timed out after {limit:g}s waiting for rank {peer}")
            ready = self._polls[peer].poll(1000 * min(_SLICE_S, remaining))
            if self.stopped is not None:
                raise HostBarrierError(f"same-host barrier stopped while waiting for rank {peer}: {self.stopped}")
            if ready:
                if os.read(fd, 1):
                    return
                raise HostBarrierError(
                    f"same-host barrier: rank {peer} closed its pipe (the peer exited, or failed and aborted)"
                )

    def stop(self, why: str) -> None:
        """Close this rank's write ends, so every peer waiting on it stops now; later waits here fail at once."""
        with self._writing:
            self.stopped = self.stopped or why
            close_all(self.outgoing)

    def close(self) -> None:
        self.stop("the ring was closed")
        close_all(self.incoming)
