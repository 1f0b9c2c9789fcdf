"""Teardown while the interpreter is whole: finish in-flight collectives, close the rings, destroy the groups.

[Note: no abort at exit] "terminate called without an active exception" (SIGABRT after the
script returned) came from finalization: a process group left alive is destroyed while Python
tears itself down, and the backend's worker threads still hold async work whose tensors are
Python objects. Freeing them takes the GIL, which a finalizing interpreter refuses by ending the
calling thread (``pthread_exit``); the forced unwind through a ``noexcept`` C++ frame calls
``std::terminate`` (pytorch/pytorch#179291, #190489). Nothing of ours must be left for that
moment. So, at exit and in this order:

1. callbacks registered with :func:`before_teardown` (the checkpoint manager's background saves,
   which still use collectives) run;
2. every collective slipstream launched and nobody waited for is waited for (bounded by the
   collective timeout; a failure is ignored: the script has returned);
3. the ring threads finish their queues and let go of their groups and shared memory;
4. on a clean exit, the process groups are destroyed (``destroy_process_group`` releases the GIL
   while gloo's threads drain their queues, so the user's own in-flight ``async_op`` work completes
   and is freed here, not in finalization).

A script that dies of an unhandled exception, or whose groups were aborted after a failed step
(``abort.py``), keeps its groups (step 4 is skipped): its peers may
never join the work still queued, and destroying would wait for the timeout instead of exiting.
The handler is registered when ``slipstream.comm`` is first imported, so it runs after every
``atexit`` handler registered later (Python runs them last-in, first-out): the user's, and the
checkpoint manager's, which also registers through :func:`before_teardown` to be sure.
"""

from __future__ import annotations

import atexit
import sys
from collections.abc import Callable

import torch.distributed as dist

from slipstream.comm.abort import aborted
from slipstream.comm.process import PROCESS
from slipstream.utils.logging import get_logger

logger = get_logger(__name__)


def before_teardown(callback: Callable[[], None]) -> None:
    """Run ``callback`` at exit before anything of comm is torn down (idempotent per callback)."""
    with PROCESS.teardown_lock:
        if callback not in PROCESS.before_teardown:
            PROCESS.before_teardown.append(callback)


def on_teardown(closer: Callable[[], None]) -> None:
    """Run ``closer`` at exit after the in-flight collectives, before the groups go (comm's own parts: rings, works)."""
    with PROCESS.teardown_lock:
        if closer not in PROCESS.closers:
            PROCESS.closers.append(closer)


def teardown() -> None:
    """The exit sequence of [Note: no abort at exit]; safe to call more than once."""
    with PROCESS.teardown_lock:
        before, closers = list(PROCESS.before_teardown), list(PROCESS.closers)
    for step in (*before, *closers):
        try:
            step()
        except Exception as err:  # noqa: BLE001 - exiting: report and go on with the rest
            logger.warning("at exit: %s failed: %s", getattr(step, "__qualname__", step), err)
    if dist.is_available() and dist.is_initialized() and not dying_of_an_exception() and not aborted():
        try:
            dist.destroy_process_group()
        except Exception as err:  # noqa: BLE001 - exiting
            logger.warning("at exit: destroying the process groups failed: %s", err)


atexit.register(teardown)


def dying_of_an_exception() -> bool:
    """Whether the interpreter is exiting because of an unhandled exception (it sets ``sys.last_value`` first)."""
    return getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None
