"""The flight recorder sees every collective the job issues, not only slipstream's own.

[Note: watching torch.distributed's calls] A hang caused by the user's code is as common as one
caused by ours: a metric ``dist.all_reduce`` that one rank skips, an ``if rank == 0:`` around a
barrier, a checkpoint agreement inside a library. The flight recorder (``flight.py``) only saw
what ``comm`` launched, so such a rank showed up as "behind" in our next collective instead of
"diverging at the user's call". When slipstream joins a process group, the collective and
point-to-point functions of the ``torch.distributed`` namespace are replaced by thin recorders
around the originals: each call is written to this rank's ring as issued (op, group, the group's
sequence number, shape, the call site ``file.py:line``) and marked completed when it returns, or
when its ``async_op`` work completes. Behaviour, arguments and return values are the originals'.

What is and is not seen:

* calls made as ``dist.all_reduce(...)`` (or ``torch.distributed.all_reduce``) from anywhere: the
  user's script, a host library, slipstream's modules outside ``comm``;
* not: a name imported before slipstream joined (``from torch.distributed import all_reduce``),
  torch's functional collectives (DTensor, FSDP2), ``isend``/``irecv`` called alone (``P2POp``
  accepts only torch's own two functions, so they stay unwrapped; ``batch_isend_irecv`` is seen),
  and torch's own nested calls (``all_gather_object``'s inner ``all_gather`` is one record);
* slipstream's ``comm`` launches record themselves with their byte counts and tags; they run
  inside :func:`quiet` so nothing is recorded twice, and so do the ring threads' exchanges.

[Note: completion callbacks run before the exit] An ``async_op`` work's record is completed by a
callback on its future, and the backend runs that callback on its own worker thread, taking the
GIL. A work the script never waited for (a metric all-reduce left in flight) may complete late on a
loaded machine: if that is after the interpreter began to finalize, taking the GIL ends the worker
thread (``pthread_exit``), and the unwind through gloo's ``noexcept`` loop aborts the process
("terminate called without an active exception", SIGABRT after the script returned; seen in CI on
``test_teardown.py``, the main thread in finalization's garbage collection). So each pending callback
holds a token in ``PROCESS.watch_pending``, and at exit (``teardown.py``) the process waits, with the
GIL released, until every callback has run (at most :data:`EXIT_GRACE_S`, 1 s after an unhandled
exception or an abort: a work whose peer never joins stays pending, and the exit goes on).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from slipstream.comm import flight
from slipstream.comm.abort import aborted
from slipstream.comm.process import PROCESS
from slipstream.comm.teardown import dying_of_an_exception, on_teardown
from slipstream.utils.flight_record import FlightRecorder, group_label

_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "scatter",
    "scatter_object_list",
    "all_reduce_coalesced",
    "all_gather_coalesced",
)
# isend/irecv stay unwrapped: ``P2POp`` accepts only torch's own two functions (checked by identity)
_POINT_TO_POINT = {"send": "p2p", "recv": "p2p_recv", "batch_isend_irecv": "p2p"}
# the recorder's op field holds 15 bytes: the flat and object variants are named by what they do
_OP_NAMES = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_single": "all_gather",
    "all_gather_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "all_reduce_coalesced": "all_reduce",
    "monitored_barrier": "barrier",
    "all_gather_object": "all_gather_obj",
    "broadcast_object_list": "broadcast_obj",
    "gather_object": "gather_obj",
    "scatter_object_list": "scatter_obj",
}
_HERE = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.abspath(dist.__file__)))


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Calls made inside record nothing here (``comm``'s own launches, which record themselves; ring threads)."""
    PROCESS.watch_local.depth = getattr(PROCESS.watch_local, "depth", 0) + 1
    try:
        yield
    finally:
        PROCESS.watch_local.depth -= 1


def install() -> None:
    """Wrap ``torch.distributed``'s collectives once per process (see the module note)."""
    with PROCESS.watch_lock:
        if PROCESS.watch_installed:
            return
        PROCESS.watch_installed = True
        for name in (*_COLLECTIVES, *_POINT_TO_POINT):
            original = getattr(dist, name, None)
            if original is None or getattr(original, "__slipstream_original__", None) is not None:
                continue
            setattr(dist, name, _watched(name, original))


def _watched(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)
    op = _POINT_TO_POINT.get(name, _OP_NAMES.get(name, name))

    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        if getattr(PROCESS.watch_local, "depth", 0) or not dist.is_initialized():
            return original(*args, **kwargs)
        try:
            values = signature.bind(*args, **kwargs).arguments
        except TypeError:  # the original will say what is wrong
            return original(*args, **kwargs)
        rank, world = dist.get_rank(), dist.get_world_size()
        recorder = flight.recorder(rank, world)
        tensor = _first_tensor(values)
        shape = f"{list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}" if tensor is not None else "objects"
        nbytes = tensor.numel() * tensor.element_size() if tensor is not None else 0
        index = recorder.issue(op, _label(name, values, rank), nbytes, shape, _call_site(), PROCESS.log.step)
        with quiet():
            try:
                result = original(*args, **kwargs)
            except BaseException:
                recorder.finish(index, ok=False)
                raise
        if values.get("async_op") and result is not None or name == "batch_isend_irecv":
            return _finish_when_done(result, recorder, index)
        recorder.finish(index)
        return result

    call.__slipstream_original__ = original  # type: ignore[attr-defined]
    return call


def _first_tensor(values: dict[str, Any]) -> torch.Tensor | None:
    for value in values.values():
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            return value[0]
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], dist.P2POp):
            return value[0].tensor
    return None


def _label(name: str, values: dict[str, Any], rank: int) -> str:
    """The group as the recorder names it (``world``, ``ranks 0-3``), or a point-to-point route."""
    group = values.get("group")
    if name == "send":
        return f"p2p {rank}->{values.get('dst', values.get('group_dst'))}"
    if name == "recv":
        return f"p2p {values.get('src', values.get('group_src'))}->{rank}"
    if name == "batch_isend_irecv":
        return f"p2p batch of {rank}"
    if group is None or group is dist.group.WORLD:
        return "world"
    try:
        return group_label(dist.get_process_group_ranks(group))
    except Exception:  # noqa: BLE001 - a group this rank is not in: the original raises
        return "unknown group"


def _call_site() -> str:
    """``file.py:line`` of the first frame outside torch.distributed and slipstream.comm: the caller's own line."""
    frame = sys._getframe(2)
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)).startswith(_HERE):
        frame = frame.f_back
    if frame is None:
        return ""
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def _finish_when_done(result: Any, recorder: FlightRecorder, index: int) -> Any:
    """Mark the record completed when the work(s) complete: through their futures, or, for point-to-point works that
    have none (gloo), when the caller's ``wait()`` returns (the works are handed back behind :class:`_WaitedWork`)."""
    works = result if isinstance(result, list) else [result]
    remaining = [len(works)]

    def done(_: Any = None) -> None:
        remaining[0] -= 1
        if remaining[0] == 0:
            recorder.finish(index)

    try:
        futures = [work.get_future() for work in works]
    except Exception:  # noqa: BLE001 - no futures here: count the waits instead
        wrapped = [_WaitedWork(work, done) for work in works]
        return wrapped if isinstance(result, list) else wrapped[0]
    for future in futures:
        future.add_done_callback(_pending(done))
    return result


def _pending(callback: Callable[[], None]) -> Callable[[Any], None]:
    """``callback`` as a future's done-callback whose run the exit waits for ([Note: completion callbacks run
    before the exit])."""
    token = object()
    PROCESS.watch_pending.add(token)

    def run(_: Any = None) -> None:
        try:
            callback()
        finally:
            PROCESS.watch_pending.discard(token)

    return run


EXIT_GRACE_S = 10.0  # the longest a clean exit waits for the callbacks of works left in flight
FAILED_EXIT_GRACE_S = 1.0  # after an unhandled exception or an abort: peers may be gone, the error is the news


def _callbacks_run(grace_s: float | None = None) -> None:
    """At exit: until every pending completion callback has run (or the grace passed), the GIL released."""
    if grace_s is None:
        grace_s = FAILED_EXIT_GRACE_S if aborted() or dying_of_an_exception() else EXIT_GRACE_S
    deadline = time.monotonic() + min(grace_s, PROCESS.timeout.total_seconds())
    while PROCESS.watch_pending and time.monotonic() < deadline:
        time.sleep(0.002)


on_teardown(_callbacks_run)


class _WaitedWork:
    """A point-to-point work whose ``wait()`` also completes its flight record; everything else is the work's own."""

    def __init__(self, work: Any, done: Callable[[], None]) -> None:
        self._work, self._done, self._waited = work, done, False

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        result = self._work.wait(*args, **kwargs)
        if not self._waited:
            self._waited = True
            self._done()
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)
