"""Each rank's entry point: run the user's script as ``__main__`` and record how it died.

``python -m slipstream.launcher.worker SCRIPT ARGS...`` behaves like ``python SCRIPT ARGS...``
(same ``sys.argv``, ``sys.path[0]`` and ``__main__``), with two additions the launcher reports from:

* an uncaught exception is written, with its traceback, to the error file torch elastic names in
  ``TORCHELASTIC_ERROR_FILE`` (the JSON layout of torch's ``@record``), so the launcher can print
  the failing rank's traceback without the user decorating their ``main``;
* when the script returns (or exits 0), a note saying so is written there instead: torch elastic
  reads the file only if the process then exits non-zero, which can only be a failure while it
  shuts down (an ``atexit`` handler, a background save that failed), and the launcher's report
  then says so instead of a bare exit code;
* ``faulthandler`` is on, so a crash in native code (segfault, abort) still prints a Python stack,
  and ``kill -USR1 <pid>`` prints every thread's stack of a rank that seems stuck.
"""

from __future__ import annotations

import faulthandler
import json
import os
import runpy
import signal
import sys
import time
import traceback

SHUTDOWN_NOTE = (
    "{script} had returned: the process failed while shutting down (an atexit handler or "
    "background work such as an asynchronous checkpoint save; its own message is in this rank's output)"
)


def record_exception(error: BaseException, script: str) -> None:
    """Write ``error`` where the agent looks for it (torch elastic's error-file format).

    The traceback starts at the user's script: the frames of this module and runpy are noise.
    """
    tb = error.__traceback__
    script = os.path.abspath(script)
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != script:
        tb = tb.tb_next
    callstack = "".join(traceback.format_exception(type(error), error, tb or error.__traceback__))
    _write_error_file(f"{type(error).__name__}: {error}", {"py_callstack": callstack})


def record_return(script: str) -> None:
    """Note that the script finished: what the report says if the process exits non-zero anyway.

    Its timestamp (which orders the report's failures) is the time of the return, the earliest
    moment a failure at shutdown can have happened.
    """
    _write_error_file(SHUTDOWN_NOTE.format(script=os.path.basename(script)), {})


def _write_error_file(message: str, extra: dict[str, str]) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": message, "extraInfo": {**extra, "timestamp": str(int(time.time()))}}}
    # [Note: the error file appears whole or not at all]
    # The agent reads this file as soon as any rank fails, while this rank may still be writing
    # it (it failed in the same collective a moment later) or be stopped mid-write by the agent's
    # SIGTERM. torch elastic parses whatever it finds; a half-written file made the whole report
    # fail with a JSONDecodeError ("could not start the job") instead of naming the killed rank.
    # Writing a sibling and renaming it over the path is atomic on POSIX.
    partial = f"{path}.{os.getpid()}.partial"
    try:
        with open(partial, "w", encoding="utf-8") as file:
            json.dump(data, file)
        os.replace(partial, path)
    except OSError:  # the report loses its traceback, the rank still fails with its own exit code
        if os.path.exists(partial):
            os.remove(partial)


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python -m slipstream.launcher.worker SCRIPT [ARGS...]")
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    faulthandler.enable()
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit:
        if exit.code is None or exit.code == 0:  # sys.exit() or sys.exit(0): the script finished
            record_return(script)
        raise
    except KeyboardInterrupt:
        raise
    except BaseException as error:
        record_exception(error, script)
        raise
    record_return(script)


if __name__ == "__main__":
    main()
