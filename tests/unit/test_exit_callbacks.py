"""The exit waits for the completion callbacks of works left in flight ([Note: completion callbacks run before the
exit] in slipstream/comm/watch.py): a backend thread that ran one after the interpreter began to finalize would
abort the process."""

from __future__ import annotations

import threading
import time

import torch

from slipstream.comm import watch
from slipstream.comm.process import PROCESS


def test_the_exit_waits_until_a_late_completion_callback_has_run() -> None:
    future: torch.futures.Future = torch.futures.Future()
    ran: list[str] = []
    future.add_done_callback(watch._pending(lambda: ran.append(threading.current_thread().name)))
    assert PROCESS.watch_pending, "a registered callback is pending until it runs"
    completer = threading.Thread(target=lambda: (time.sleep(0.2), future.set_result(None)), name="backend")
    completer.start()
    watch._callbacks_run()
    assert ran == ["backend"], ran  # run by the completing thread, and before the exit went on
    assert not PROCESS.watch_pending
    completer.join()


def test_a_work_that_never_completes_holds_the_exit_only_for_the_grace_period() -> None:
    future: torch.futures.Future = torch.futures.Future()
    future.add_done_callback(watch._pending(lambda: None))
    start = time.monotonic()
    watch._callbacks_run(grace_s=0.1)
    assert time.monotonic() - start < 5.0  # the exit goes on (a peer that never joins must not hold it)
    assert len(PROCESS.watch_pending) == 1
    future.set_result(None)  # completes here, on this thread: the token goes
    assert not PROCESS.watch_pending
