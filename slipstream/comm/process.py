"""What comm keeps for this process between calls, in one object: ``PROCESS``.

[Note: one owner of comm's state]
Collectives are module functions (``comm.all_reduce(...)``), so what they remember between calls
belongs to the process, not to a strategy: the collective timeout, whether this rank aborted its
groups, the works launched and not yet waited for, the flight recorder and its run generation, the
lane and ring groups made so far, the callbacks of the exit sequence, the comms log. Each was a
global of its own module; they are the attributes of one object here, so a reader sees in one
place what comm carries from call to call, and the one module-level binding is this object's
(``tests/unit/test_architecture.py`` refuses module-level mutable state anywhere else in comm).
The streams and events of one strategy's traffic are a different thing, owned by that strategy:
``context.CommContext``.

Each group of attributes has its own lock, held by the module that uses it, as before.
"""

from __future__ import annotations

import datetime
import threading
import weakref
from collections.abc import Callable
from typing import Any

from slipstream.comm.comms_log import CommsLog

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


class ProcessComm:
    def __init__(self) -> None:
        # distributed.py: the timeout the default group was created with (groups we add inherit it)
        self.timeout: datetime.timedelta = DEFAULT_TIMEOUT
        # abort.py: this rank aborted its process groups after a failed step
        self.aborted = False
        # collectives.py: works launched and not yet waited for; groups whose backend lacks reduce_scatter
        self.in_flight: weakref.WeakSet[Any] = weakref.WeakSet()
        self.reduce_scatter_unsupported: set[str] = set()
        # comm/flight.py: this process's recorder, the run generation (bumped by reset), the last hang report
        self.recorder: Any = None
        self.generation = 0
        self.last_report: Any = None
        # lanes.py: (parent group id, lane) -> (the parent, its lane twin)
        self.lanes: dict[tuple[int, str], tuple[Any, Any]] = {}
        self.lanes_lock = threading.Lock()
        # ring_collectives.py: group id -> its ring context
        self.rings: dict[int, Any] = {}
        self.rings_lock = threading.Lock()
        # teardown.py: run before the groups go, then the closers
        self.before_teardown: list[Callable[[], None]] = []
        self.closers: list[Callable[[], None]] = []
        self.teardown_lock = threading.Lock()
        # watch.py: torch.distributed's functions wrapped once; per-thread nesting
        self.watch_installed = False
        self.watch_lock = threading.Lock()
        self.watch_local = threading.local()
        self.watch_pending: set[object] = set()  # a token per async work whose completion callback has not run
        # overlap.py: the pair and side of the half running on each thread
        self.overlap_local = threading.local()
        # comms_log.py: every collective of the current step
        self.log = CommsLog()


PROCESS = ProcessComm()
