"""Each rank's entry point: run the user's script as ``__main__`` and record how it died.

``python -m slipstream.launcher.worker SCRIPT ARGS...`` behaves like ``python SCRIPT ARGS...``
(same ``sys.argv``, ``sys.path[0]`` and ``__main__``), with two additions the launcher reports from:

* an uncaught exception is written, with its traceback, to the error file torch elastic names in
  ``TORCHELASTIC_ERROR_FILE`` (the JSON layout of torch's ``@record``), so the launcher can print
  the failing rank's traceback without the user decorating their ``main``;
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


def record_exception(error: BaseException, script: str) -> None:
    """Write ``error`` where the agent looks for it (torch elastic's error-file format).

    The traceback starts at the user's script: the frames of this module and runpy are noise.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    tb = error.__traceback__
    script = os.path.abspath(script)
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != script:
        tb = tb.tb_next
    data = {
        "message": {
            "message": f"{type(error).__name__}: {error}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(type(error), error, tb or error.__traceback__)),
                "timestamp": str(int(time.time())),
            },
        }
    }
    try:
        with open(path, "w", encoding="utf-8") as file:
            json.dump(data, file)
    except OSError:
        pass  # the report loses its traceback, the rank still fails with its own exit code


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
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as error:
        record_exception(error, script)
        raise


if __name__ == "__main__":
    main()
