"""A rank whose step raises tells its peers, so they stop at once with its error instead of waiting for the timeout.

[Note: fail together, at once] When one rank's step raises (the user's model fails on its data, a
shape error in one pipeline stage), its peers are left in a collective or a pipeline receive the
failed rank will never join, and wait there for ``comms_timeout_seconds``, then report a timeout
that says nothing of the real error. So the failing rank, before its exception leaves the engine:

1. publishes its error in the job's store (``slipstream/failure``; the first failure wins, through
   ``compare_set``, so ranks that fail *because* of it do not overwrite it);
2. aborts every process group (gloo and NCCL both implement ``abort``): its connections close and
   each peer waiting on it gets "connection closed" at once, which :class:`CollectiveError` turns
   into "rank 1 failed: ValueError: …" by reading the store.

A peer that stops this way raises a :class:`CollectiveError` in its own step, which aborts its groups
in turn, so ranks several hops away stop too. Errors raised alike on every rank by agreement
(``comm.agree``) carry ``raised_on_every_rank`` and abort nothing: no peer waits; nor do
slipstream's deliberate refusals (see :func:`leaves_peers_waiting`). After an abort this process's
groups are unusable; :func:`aborted` says so (the exit sequence then leaves them to the OS rather
than destroying them).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from slipstream.comm.process import PROCESS
from slipstream.errors import SlipstreamError
from slipstream.utils.logging import get_logger

logger = get_logger(__name__)

F = TypeVar("F", bound=Callable[..., Any])
FAILURE_KEY = "slipstream/failure"


def aborted() -> bool:
    """Whether this process aborted its process groups after a failed step."""
    return PROCESS.aborted


def mark_raised_on_every_rank(error: BaseException) -> BaseException:
    """Tag ``error`` as one every rank raises together (no peer is left waiting, so nothing is aborted)."""
    error.raised_on_every_rank = True  # type: ignore[attr-defined]
    return error


def leaves_peers_waiting(error: BaseException) -> bool:
    """Whether ``error`` may have left other ranks in a collective this rank will not join.

    Yes for the user's own errors (the model failed on this rank's data) and for a broken collective
    (``CollectiveError``: aborting passes the news on to ranks further away). No for an error raised
    alike on every rank by agreement, and for slipstream's deliberate refusals (``ConfigError``,
    ``UsageError``: raised from the config, the call sequence or the batch's shape before the step's
    collectives, the same way on every rank that sees the same input; a rank that alone sees a bad
    batch leaves its peers to the collective timeout, which names the collective).
    """
    if getattr(error, "raised_on_every_rank", False):
        return False
    if isinstance(error, SlipstreamError):
        return bool(getattr(error, "breaks_communication", False))
    return True


def tells_peers_on_failure(call: str) -> Callable[[F], F]:
    """For the engine's step calls: an exception leaving ``call`` that may leave peers waiting is published and the
    groups aborted (see the module's note). A plain ``try`` rather than a context manager: this is on every step."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except Exception as err:
                if leaves_peers_waiting(err):
                    abort_for(err, call)
                raise

        return wrapped  # type: ignore[return-value]

    return wrap


def abort_for(error: BaseException, call: str) -> None:
    """Publish ``error`` as this rank's failure in ``call`` and abort every process group (once; world > 1 only)."""
    if PROCESS.aborted or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    rank = dist.get_rank()
    text = f"rank {rank}: {call}: {type(error).__name__}: {' '.join(str(error).split())[:500]}"
    try:
        store = dist.distributed_c10d._get_default_store()
        store.compare_set(FAILURE_KEY, "", text)
    except Exception as err:  # noqa: BLE001 - the abort below still frees the peers
        logger.warning("could not publish this rank's failure to the store: %s", err)
    PROCESS.aborted = True
    groups = list(dist.distributed_c10d._world.pg_map)
    for group in groups:
        with contextlib.suppress(Exception):
            group.abort()
    with PROCESS.rings_lock:  # the same-host rings meet at pipes, not in a group: closing them frees the peers too
        rings = list(PROCESS.rings.values())
    for ring in rings:
        with contextlib.suppress(Exception):
            ring.abort(text)
    logger.error(
        "%s; aborted this rank's %d process group(s) so the other ranks stop now with this error", text, len(groups)
    )


def failure_of_a_peer() -> str | None:
    """The first failure a rank published (``rank r: call: Error: message``), if any; never waits."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
        if not store.check([FAILURE_KEY]):
            return None
        return store.get(FAILURE_KEY).decode(errors="replace") or None
    except Exception:  # noqa: BLE001 - a report must never hide the caller's own error
        return None
