"""Ring reduce-scatter and all-gather from point-to-point exchanges, for backends that do them badly.

[Note: why not gloo's own] Measured on the 2-core dev machine (2 ranks, 100 MB, torch 2.13):
gloo's all-reduce takes 96 ms, but its reduce-scatter 182 ms (and allocates a full-size copy) and
its all-gather 167 ms; an exchange of halves over send/recv takes 49 ms. ZeRO-1/2 move their
gradients and weights with exactly these two collectives, so on gloo we run the textbook ring:
N-1 steps, each sending one chunk to the next rank and receiving one from the previous.

A ring needs the previous step's data before the next, so it runs on one background thread (the
CPU analogue of a communication stream) with its own process group: collectives queue in launch
order, identical on every rank, and never interleave with the default group's traffic.

When every rank of the group shares one host, the same two collectives go through shared memory
instead of the sockets (``shm.py``, [Note: shared memory between ranks of one host]), still on
this thread and in this order.
"""

from __future__ import annotations

import concurrent.futures
import threading

import torch
import torch.distributed as dist

from slipstream.comm import watch
from slipstream.comm.distributed import current_timeout
from slipstream.comm.lanes import twin_group
from slipstream.comm.process import PROCESS
from slipstream.comm.shm import shared_slots
from slipstream.comm.teardown import on_teardown

RING_BACKENDS = {"gloo"}


class RingContext:
    """The ring's process group (a twin of ``group``) and the thread that drives it."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.parent = group if group is not None else dist.group.WORLD
        ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
        self.group = twin_group(group, "gloo")  # a subgroup's ring is made by its members only (lanes.py)
        self.size = len(ranks)
        self.rank = dist.get_rank(self.group)
        self.next_peer = ranks[(self.rank + 1) % self.size]
        self.prev_peer = ranks[(self.rank - 1) % self.size]
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="slipstream-ring")
        self.failure: str | None = None  # the first failed job's error: later jobs are refused (see submit)
        # Ranks of one host exchange through shared memory instead (see [Note: shared memory between ranks of one host]).
        self.shared = shared_slots(self.group, self.rank, self.size)
        self._left: list = []  # shared memory given up by an abort, closed with the ring
        self._turn = threading.Lock()  # held by the running job, on the ring thread or inline
        self._turns = threading.Lock()  # guards the count below
        self._queued = 0  # jobs submitted and not finished

    def _exchange(self, send: torch.Tensor, receive: torch.Tensor) -> None:
        ops = [
            dist.P2POp(dist.isend, send, self.next_peer, group=self.group),
            dist.P2POp(dist.irecv, receive, self.prev_peer, group=self.group),
        ]
        for request in dist.batch_isend_irecv(ops):
            request.wait(current_timeout())  # explicit: gloo's receives otherwise wait forever

    def reduce_scatter(self, buffer: torch.Tensor) -> None:
        """Sum ``buffer`` over ranks in place; afterwards chunk ``rank`` holds the full sum."""
        if self.shared is not None:
            self.shared.reduce_scatter(buffer)
            return
        chunks = buffer.view(self.size, -1)
        incoming = torch.empty_like(chunks[0])
        for step in range(self.size - 1):
            self._exchange(chunks[(self.rank - step - 1) % self.size], incoming)
            chunks[(self.rank - step - 2) % self.size].add_(incoming)

    def all_gather(self, buffer: torch.Tensor) -> None:
        """Fill every chunk of ``buffer`` from its owner; chunk ``rank`` must already hold ours."""
        if self.shared is not None:
            self.shared.all_gather(buffer)
            return
        chunks = buffer.view(self.size, -1)
        for step in range(self.size - 1):
            self._exchange(chunks[(self.rank - step) % self.size], chunks[(self.rank - step - 1) % self.size])

    def submit(self, fn, *args, inline: bool = False) -> concurrent.futures.Future:  # noqa: ANN001
        """Queue ``fn(*args)`` on the ring thread; with ``inline``, run it on this thread instead if the ring is idle.

        [Note: waited-for collectives run inline] Handing a job to the ring thread and its result back costs
        two thread wake-ups: measured at 2 ranks, ~95 µs, where the shared-memory barrier itself takes ~26 µs.
        For a small collective the caller waits for at once (the gradient norm and used flags, the updated
        weights' all-gather of a small model) that hop was most of its time. So when nothing is queued or
        running on the ring, such a job runs at once on the caller's thread (it returns done), in order with
        the ring's other jobs: every job, here or there, holds the ring's one turn while it runs.

        Only a collective the caller waits for before it issues one on another group may run so: ZeRO-3's
        gathers and reductions go over two rings, and ranks whose forward paths differ issue them in
        different orders; on their threads each ring still makes progress, but a rank blocked inside one
        would leave its peer blocked inside the other (measured: a deadlock). Waiting at once, the caller
        blocks either way; inline it blocks without the hop.
        """
        with self._turns:
            idle = self._queued == 0
            self._queued += 1
        if inline and idle:
            future: concurrent.futures.Future = concurrent.futures.Future()
            try:
                future.set_result(self._run(fn, *args))
            except Exception as err:  # noqa: BLE001 - delivered through the future, as from the thread
                future.set_exception(err)
            return future
        return self.executor.submit(self._run, fn, *args)

    def _run(self, fn, *args) -> object:  # noqa: ANN001
        # [Note: no autograd on the ring thread] Grad mode is thread-local and on by default in a new
        # thread; a collective's copies into buffers (views made under no_grad inside an autograd
        # Function's forward) must never be recorded, or torch refuses the in-place write.
        # [Note: a failed ring fails fast] After a timeout the ring's group is unusable, and every
        # job still queued would wait out its own timeout: at interpreter exit the executor runs them
        # all, one after the other (30 s for six gradient buckets at a 5 s limit), before the rank
        # can exit and the launcher can report. So the first failure fails the queued jobs at once.
        try:
            with self._turn:
                if self.failure is not None:
                    raise RuntimeError(f"not run: an earlier collective on this ring failed ({self.failure})")
                try:
                    # the ring's exchanges are recorded as the collective they make up
                    with torch.no_grad(), watch.quiet():
                        return fn(*args)
                except Exception as err:
                    self.failure = f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"
                    raise
        finally:
            with self._turns:
                self._queued -= 1

    def abort(self, why: str) -> None:
        """This rank failed: peers waiting at the shared-memory barrier stop now (see [Note: a barrier of pipes]).

        This rank's later collectives on the ring go over its sockets: its pipes are closed for good, and a peer
        reaches them only to fail (and abort in turn, so the ranks agree again). Ranks that all raised alike and
        carry on (the epoch idiom's ``StopIteration`` from ``train_batch``) all aborted, so all leave the shared path.
        """
        shared, self.shared = self.shared, None
        if shared is not None:
            shared.barrier.stop(f"aborted: {why}")
            self._left.append(shared)

    def close(self) -> None:
        """Finish queued jobs and let go of the thread and the shared memory (the group goes with the context)."""
        self.executor.shutdown(wait=True)
        for shared in [self.shared, *self._left]:
            if shared is not None:
                shared.close()
        self.shared, self._left = None, []


def _close_rings() -> None:
    """[Note: rings closed before the interpreter]
    A ring holds its twin process group, its thread and its shared-memory views for as long as it
    lives, so after the user's ``destroy_process_group`` the group's last reference was ours and
    went only at interpreter finalization, where a gloo thread freeing a tensor aborts the process
    (see [Note: no abort at exit] in teardown.py). Closing the rings at exit, while the interpreter
    is whole, takes our part out of finalization, in a defined order.
    """
    with PROCESS.rings_lock:
        contexts = list(PROCESS.rings.values())
        PROCESS.rings.clear()
    for context in contexts:
        context.close()


on_teardown(_close_rings)  # at exit, after in-flight collectives and before the groups go (teardown.py)


def ring_context(group: dist.ProcessGroup | None) -> RingContext | None:
    """The ring for ``group`` if its backend benefits from one, else None. Collective on first use."""
    if str(dist.get_backend(group)) not in RING_BACKENDS or dist.get_world_size(group) == 1:
        return None
    parent = group if group is not None else dist.group.WORLD
    key = id(parent)
    with PROCESS.rings_lock:
        context = PROCESS.rings.get(key)
        if context is None or context.parent is not parent:  # a destroyed-and-recreated world
            context = PROCESS.rings[key] = RingContext(group)
        return context


def existing_ring(group: dist.ProcessGroup | None) -> RingContext | None:
    """The ring already made for ``group`` (by :func:`ring_context`), else None; never collective, so a collective
    that only uses a ring when one exists cannot block in the ring's set-up while a peer is elsewhere."""
    parent = group if group is not None else dist.group.WORLD
    with PROCESS.rings_lock:
        context = PROCESS.rings.get(id(parent))
    return context if context is not None and context.parent is parent else None
