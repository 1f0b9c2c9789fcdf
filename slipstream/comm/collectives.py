"""Collectives with async handles that name themselves when something goes wrong.

Every call is recorded in the comms log (``comm.comms_log``, owned by comm/process.py). A failed or timed-out wait raises
:class:`CollectiveError` saying which rank, which operation and what it was moving, instead of
the backend's bare "Timed out waiting 1800000ms for recv operation".
"""

from __future__ import annotations

import concurrent.futures
import datetime
import pickle
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from slipstream.comm import flight, watch
from slipstream.comm.abort import failure_of_a_peer
from slipstream.comm.comms_log import CommRecord
from slipstream.comm.distributed import current_timeout
from slipstream.comm.process import PROCESS
from slipstream.comm.ring_collectives import existing_ring, ring_context
from slipstream.comm.shm import FOLDS
from slipstream.comm.teardown import on_teardown
from slipstream.errors import SlipstreamError
from slipstream.utils.flight_record import FlightRecorder, group_label

ReduceOp = dist.ReduceOp


class CollectiveError(SlipstreamError, RuntimeError):
    """A collective failed or timed out; the message names the rank and the operation."""

    breaks_communication = True  # the rank's groups are unusable: its peers are told (abort.py)


class Work:
    """Handle of an asynchronous collective; :meth:`wait` blocks until the result is usable."""

    def __init__(
        self,
        work: dist.Work | None,
        record: CommRecord,
        group: dist.ProcessGroup | None,
        on_complete: Callable[[], None] | None = None,
        flight_entry: tuple[FlightRecorder, int] | None = None,
        start: float | None = None,
    ) -> None:
        self._work = work
        self._record = record
        self._group = group
        self._on_complete = on_complete
        self._flight_entry = flight_entry  # (the recorder it was issued to, its index there)
        self._start = time.perf_counter() if start is None else start  # a collective run inline began before its handle
        self.done = work is None
        if not self.done:
            PROCESS.in_flight.add(self)

    def is_completed(self) -> bool:
        """Whether :meth:`wait` would return at once (it must still be called, to finish the record)."""
        return self.done or self._work.is_completed()

    def wait(self) -> None:
        if self.done:
            return
        try:
            # An explicit limit: without one gloo's point-to-point receives wait forever, whatever the group's timeout.
            self._work.wait(current_timeout())
        except Exception as err:  # the backend raises RuntimeError/DistBackendError variants
            PROCESS.in_flight.discard(self)  # reported: nothing waits for it again at exit
            raise CollectiveError(self._describe(err)) from err
        self.done = True
        PROCESS.in_flight.discard(self)
        if self._flight_entry is not None:
            recorder, index = self._flight_entry
            recorder.finish(index)
        self._record.seconds = time.perf_counter() - self._start
        if self._on_complete is not None:
            self._on_complete()

    def _describe(self, err: BaseException) -> str:
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size(self._group) if dist.is_initialized() else 1
        elapsed = time.perf_counter() - self._start
        what = f"{self._record.op}" + (f" of {self._record.tag}" if self._record.tag else "")
        timed_out = "timed out" in str(err).lower() or "timeout" in str(err).lower()
        reason = "timed out" if timed_out else "failed"
        # PROCESS.log.step is the number of optimizer steps taken, so this collective belongs to the
        # step after it (0-based: the engine's global_steps while the step runs).
        hint = (
            f" (the limit is comms_timeout_seconds = {current_timeout().total_seconds():g}; raise it "
            "only if this step legitimately takes longer)"
            if timed_out
            else ""
        )
        if self._flight_entry is not None:
            recorder, index = self._flight_entry
            recorder.finish(index, ok=False)
        if not _from_peer(err):  # a local error (autograd, dtype, shape): do not send the user after another rank
            return (
                f"rank {rank}/{world}: {what} ({self._record.nbytes / 2**20:.2f} MiB) in step {PROCESS.log.step} failed on "
                f"this rank ({type(err).__name__}, not a communication error): {err}"
            )
        failed = failure_of_a_peer()
        if failed is not None:  # a peer's step raised and it aborted its groups (see abort.py): its error is the news
            return (
                f"rank {rank}/{world}: {what} in step {PROCESS.log.step} stopped after {elapsed:.1f}s because another rank "
                f"failed first — {failed}. Backend said: {_one_line(err)}"
            )
        return (
            f"rank {rank}/{world}: {what} ({self._record.nbytes / 2**20:.2f} MiB) in step {PROCESS.log.step} "
            f"{reason} after {elapsed:.1f}s{hint}. Another rank probably died or took a different code path "
            f"(e.g. skipped backward or step). Backend said: {_one_line(err)}. Flight record: {_culprit(elapsed)}"
        )


def _finish_in_flight() -> None:
    """At exit: wait for every collective launched and not waited for, so no backend thread still holds its tensors
    when the interpreter finalizes (see [Note: no abort at exit] in teardown.py). A failure no longer matters."""
    for work in list(PROCESS.in_flight):
        try:
            work.wait()
        except Exception:  # noqa: BLE001 - the script has returned; its peers may be gone
            pass


on_teardown(_finish_in_flight)


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def _culprit(elapsed: float) -> str:
    """The flight recorder's verdict (see comm/flight.py): who holds the group up, from the rings this rank can get.

    The other ranks' rings are awaited for half the time this collective waited (at most 10 s): ranks
    stuck in the same collective time out within about that."""
    try:
        store = dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
        wait_s = min(10.0, max(1.0, elapsed / 2))
        return flight.report_for(*_rank_and_world(), store=store, wait_s=wait_s).summary
    except Exception as err:  # noqa: BLE001 - the report must never hide the collective's own error
        return f"unavailable ({type(err).__name__}: {err})"


def _rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _shape(tensor: torch.Tensor) -> str:
    return f"{list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"


def _launch(
    op: str,
    tensor: torch.Tensor,
    tag: str,
    group: dist.ProcessGroup | None,
    call: Callable[[], dist.Work],
    on_complete: Callable[[], None] | None = None,
    nbytes: int | None = None,
    route: str = "",
) -> Work:
    """Log, record in the flight ring and start one collective. ``route`` (``"1->3"``) names a point-to-point transfer's ends."""
    record = PROCESS.log.add(op, tensor.numel() * tensor.element_size() if nbytes is None else nbytes, tag, group)
    label = f"p2p {route}" if route else group_label(record.ranks)
    recorder = flight.recorder(*_rank_and_world())
    entry = (recorder, recorder.issue(op, label, record.nbytes, _shape(tensor), tag, PROCESS.log.step))
    start = time.perf_counter()
    try:
        with watch.quiet():  # recorded above, with our tag: the watcher of torch.distributed must not record it again
            work = call()
    except Exception as err:
        handle = Work(None, record, group, flight_entry=entry, start=start)
        raise CollectiveError(handle._describe(err)) from err
    return Work(work, record, group, on_complete, entry, start)


_PEER_SIGNS = (
    "timed out",
    "timeout",
    "connection",
    "closed",
    "peer",
    "socket",
    "broken pipe",
    "reset",
    "abort",
    "nccl",
    "gloo",
)


def _from_peer(err: BaseException) -> bool:
    """Whether a failed collective points at another rank (a backend/transport error) or at this rank's own code."""
    return isinstance(err, getattr(dist, "DistBackendError", ())) or any(
        sign in str(err).lower() for sign in _PEER_SIGNS
    )


def all_reduce(
    tensor: torch.Tensor,
    op: dist.ReduceOp.RedOpType = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    tag: str = "",
    inline: bool = False,
) -> Work:
    """In-place all-reduce, launched asynchronously (``inline``: see :func:`all_gather_into_tensor`). Between ranks of one host it goes through shared memory
    on the ring thread (see [Note: the small all-reduce] in shm.py), in order with the ring's other collectives,
    once the group has a ring (the engine makes one for each group it reduces over)."""
    if dist.get_world_size(group) == 1:
        return _alone("all_reduce", tensor, tag, group)  # every reduction of one value is that value
    if op in FOLDS and tensor.device.type == "cpu" and tensor.is_contiguous() and tensor.dtype != torch.bool:
        ring = existing_ring(group)  # made by the engine for its groups at set-up: a first use here could block
        if ring is not None and ring.shared is not None:
            shared = ring.shared
            return _launch(
                "all_reduce",
                tensor,
                tag,
                group,
                lambda: _FutureWork(ring.submit(shared.all_reduce, tensor, op, inline=inline)),
            )
    return _launch("all_reduce", tensor, tag, group, lambda: dist.all_reduce(tensor, op=op, group=group, async_op=True))


def all_to_all_single(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None, tag: str = ""
) -> Work:
    """Even all-to-all: chunk ``i`` of ``input`` (split on dim 0) goes to rank ``i``; logged as the bytes that leave
    for other ranks, ``(n−1)/n`` of the input, as ``all_to_all_v`` logs its rows (a rank's own chunk never moves)."""
    n = dist.get_world_size(group)
    nbytes = input.numel() * input.element_size() * (n - 1) // n
    return _launch(
        "all_to_all",
        input,
        tag,
        group,
        lambda: dist.all_to_all_single(output, input, group=group, async_op=True),
        nbytes=nbytes,
    )


def all_to_all_v(
    output: torch.Tensor,
    input: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup | None = None,
    tag: str = "",
) -> Work:
    """Uneven all-to-all on dim 0 (``input_splits[i]`` rows go to rank ``i``); logged as the bytes that leave for other ranks."""
    me = dist.get_rank(group)
    row = input[0].numel() * input.element_size() if input.dim() and input.shape[0] else 0
    return _launch(
        "all_to_all",
        input,
        tag,
        group,
        lambda: dist.all_to_all_single(output, input, output_splits, input_splits, group=group, async_op=True),
        nbytes=row * sum(n for i, n in enumerate(input_splits) if i != me),
    )


def shift_ring(
    send: torch.Tensor, recv: torch.Tensor, to: int, source: int, group: dist.ProcessGroup | None = None, tag: str = ""
) -> Work:
    """Send ``send`` to global rank ``to`` while receiving ``recv`` from global rank ``source`` (one ring step); logged as the bytes sent."""

    def call() -> dist.Work:
        ops = [dist.P2POp(dist.isend, send, to, group), dist.P2POp(dist.irecv, recv, source, group)]
        works = dist.batch_isend_irecv(ops)
        return _AllWorks(works)  # type: ignore[return-value]

    return _launch("p2p", send, tag, group, call, route=f"{source}->{dist.get_rank()}->{to}")


class _AllWorks:
    """Several backend handles waited on as one."""

    def __init__(self, works: list[dist.Work]) -> None:
        self.works = works

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        for work in self.works:
            work.wait() if timeout is None else work.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, tag: str = "") -> Work:
    return _launch("broadcast", tensor, tag, group, lambda: dist.broadcast(tensor, src=src, group=group, async_op=True))


# torch 2.13 renamed the flat collectives (*_single); older releases only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into_tensor(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    tag: str = "",
    inline: bool = False,
) -> Work:
    """Gather equal-sized shards from every rank into one flat ``output`` (rank order).

    ``shard`` may be ``output``'s own chunk (in place). On gloo this runs as a ring (see ``ring``).
    ``inline``: the caller waits for this before it issues a collective on another group, so where the
    group's ring is idle it may run on the caller's thread ([Note: waited-for collectives run inline]).
    """
    mine = _own_chunk(output, group)
    if dist.get_world_size(group) == 1:
        return _alone("all_gather", output, tag, group, mine, shard)
    ring = ring_context(group) if output.device.type == "cpu" else None
    if ring is not None:

        def run() -> None:
            if mine.data_ptr() != shard.data_ptr():
                mine.copy_(shard)
            ring.all_gather(output)

        return _launch("all_gather", output, tag, group, lambda: _FutureWork(ring.submit(run, inline=inline)))
    if shard.data_ptr() == mine.data_ptr():
        shard = shard.clone()  # backend collectives may not read what they overwrite
    return _launch(
        "all_gather", output, tag, group, lambda: _all_gather_flat(output, shard, group=group, async_op=True)
    )


def _alone(
    op: str,
    tensor: torch.Tensor,
    tag: str,
    group: dist.ProcessGroup | None,
    destination: torch.Tensor | None = None,
    source: torch.Tensor | None = None,
) -> Work:
    """A collective over a group of one rank: its result is its input, copied where it is wanted, at once.

    [Note: groups of one] Expert parallel at ep = world leaves each expert's data-parallel group a
    single rank, and ZeRO-1/2 still reduce-scattered its buckets every step. gloo's reduce-scatter
    allocates a full-size copy of its input, and an output aliasing the input took another one:
    two bucket-sized temporaries per bucket and step whose varying lifetimes fragmented glibc's
    heap. Measured on the Mixtral of bench_expert_parallel.py (ep 2, ZeRO-2), RSS grew ~60 MB a
    step with the tensors held constant. Nothing needs to move, so nothing is launched.

    It is logged in the comms log but has no flight-recorder entry and no handle to track: a
    collective no other rank takes part in cannot hang or diverge, and that bookkeeping was a
    quarter of a one-rank step on a tiny model (bench_overhead.py, 10 tensors).
    """
    if destination is not None and source is not None and destination.data_ptr() != source.data_ptr():
        destination.copy_(source)
    return Work(None, PROCESS.log.add(op, tensor.numel() * tensor.element_size(), tag, group), group)


class _FutureWork:
    """Adapts a Future from the ring thread to the ``wait()`` of a backend work handle."""

    def __init__(self, future: concurrent.futures.Future) -> None:
        self.future = future

    def wait(self, timeout: datetime.timedelta | None = None) -> None:
        try:
            self.future.result(None if timeout is None else timeout.total_seconds())
        except concurrent.futures.TimeoutError:
            raise RuntimeError(f"timed out after {timeout.total_seconds():g}s waiting for the ring thread") from None

    def is_completed(self) -> bool:
        return self.future.done()


def _own_chunk(flat: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return flat.view(dist.get_world_size(group), -1)[dist.get_rank(group)]


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    tag: str = "",
    inline: bool = False,
) -> Work:
    """Sum ``input`` over ranks and leave chunk ``rank`` of the result in ``output``.

    ``input`` is scratch: it may be overwritten. ``output`` may be ``input``'s own chunk (in place).
    On gloo this runs as a ring on the ring thread (see ``ring``); where a backend has no
    reduce-scatter it falls back to an all-reduce plus a copy, logged as an all-reduce.
    """
    chunk = _own_chunk(input, group)
    if dist.get_world_size(group) == 1:
        return _alone("reduce_scatter", input, tag, group, output, chunk)
    ring = ring_context(group) if input.device.type == "cpu" else None
    if ring is not None:

        def run() -> None:
            ring.reduce_scatter(input)
            if output.data_ptr() != chunk.data_ptr():
                output.copy_(chunk)

        return _launch("reduce_scatter", input, tag, group, lambda: _FutureWork(ring.submit(run, inline=inline)))
    aliased = output.data_ptr() == chunk.data_ptr()
    backend = str(dist.get_backend(group))
    if backend not in PROCESS.reduce_scatter_unsupported:
        target = torch.empty_like(output) if aliased else output  # backend collectives may not alias
        try:
            return _launch(
                "reduce_scatter",
                input,
                tag,
                group,
                lambda: _reduce_scatter_flat(target, input, group=group, async_op=True),
                on_complete=(lambda: output.copy_(target)) if aliased else None,
            )
        except CollectiveError as err:
            if not _is_unsupported(err):
                raise
            PROCESS.log.records.pop()
            PROCESS.reduce_scatter_unsupported.add(backend)
    return _launch(
        "all_reduce",
        input,
        tag + " (reduce-scatter fallback)",
        group,
        lambda: dist.all_reduce(input, group=group, async_op=True),
        on_complete=None if aliased else (lambda: output.copy_(chunk)),
    )


def _is_unsupported(err: BaseException) -> bool:
    text = str(err.__cause__ or err).lower()
    return "not supported" in text or "unsupported" in text or "not implemented" in text


# [Note: objects on the recorded path] Small Python objects (checkpoint agreements, error texts, a manifest's
# entries) cross ranks as pickled bytes in two recorded collectives, their sizes then the bytes padded to the
# largest, so the flight recorder names them like every tensor collective: the checkpoint agreements are where
# ranks that took different paths most often meet. The peers are this job's own ranks.
def _object_bytes(obj: Any, group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.device]:
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        from slipstream.accelerator import get_accelerator

        device = get_accelerator().device()
    data = pickle.dumps(obj)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device), device


def _object_of(data: torch.Tensor, size: int) -> Any:
    return pickle.loads(data[:size].cpu().numpy().tobytes())


def _sizes(data: torch.Tensor, group: dist.ProcessGroup | None, tag: str) -> list[int]:
    world = dist.get_world_size(group)
    sizes = torch.zeros(world, dtype=torch.int64, device=data.device)
    all_gather_into_tensor(
        sizes, torch.tensor([data.numel()], dtype=torch.int64, device=data.device), group, f"{tag} (sizes)"
    ).wait()
    return [int(n) for n in sizes.tolist()]


def all_gather_objects(obj: Any, group: dist.ProcessGroup | None = None, tag: str = "objects") -> list[Any]:
    """Every rank's ``obj`` (picklable, small: metadata, error texts), in rank order; ``[obj]`` without a process group.
    See [Note: objects on the recorded path]."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [obj]
    data, device = _object_bytes(obj, group)
    sizes = _sizes(data, group, tag)
    longest = max(sizes)
    every = torch.zeros(len(sizes) * longest, dtype=torch.uint8, device=device)
    all_gather_into_tensor(every, torch.nn.functional.pad(data, (0, longest - data.numel())), group, tag).wait()
    return [_object_of(every[i * longest : (i + 1) * longest], n) for i, n in enumerate(sizes)]


def gather_objects(obj: Any, dst: int = 0, tag: str = "objects") -> list[Any] | None:
    """Every rank's ``obj`` in rank order on global rank ``dst`` (None elsewhere): for objects too large to give every
    rank (a model's weights for ``consolidated_state_dict``). ``[obj]`` without a process group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    data, device = _object_bytes(obj, None)
    sizes = _sizes(data, None, tag)
    longest, here = max(sizes), dist.get_rank() == dst
    padded = torch.nn.functional.pad(data, (0, longest - data.numel()))
    slots = [torch.zeros(longest, dtype=torch.uint8, device=device) for _ in sizes] if here else None
    _launch(
        "gather", padded, tag, None, lambda: dist.gather(padded, slots, dst=dst, async_op=True), nbytes=padded.numel()
    ).wait()
    return [_object_of(slot, n) for slot, n in zip(slots, sizes, strict=True)] if slots is not None else None


def broadcast_object(obj: Any, src: int = 0, group: dist.ProcessGroup | None = None, tag: str = "object") -> Any:
    """Global rank ``src``'s ``obj`` (picklable, small: a verdict, a few dozen tokens) on every rank of ``group``;
    ``obj`` itself without a process group or alone in it. See [Note: objects on the recorded path]."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return obj
    data, device = _object_bytes(obj if dist.get_rank() == src else None, group)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    broadcast(size, src, group, f"{tag} (size)").wait()
    buffer = data if dist.get_rank() == src else torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    broadcast(buffer, src, group, tag).wait()
    return obj if dist.get_rank() == src else _object_of(buffer, int(size.item()))


def barrier(group: dist.ProcessGroup | None = None, tag: str = "") -> None:
    from slipstream.accelerator import get_accelerator

    token = torch.zeros(1, device=get_accelerator().device())
    all_reduce(token, group=group, tag=tag or "barrier").wait()
