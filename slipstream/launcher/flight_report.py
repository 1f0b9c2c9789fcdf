"""The agent's side of goodput: a per-run directory on /dev/shm for the ranks' flight rings and
in-memory snapshots, and the hang report when a rank fails.

Each rank writes its last collectives into a ring file of the directory this module sets up
(``slipstream/utils/flight_record.py``, analysed by ``flight_analysis.py``). When the agent sees the first rank of an attempt fail (an exit, a
signal, a collective that timed out), it reads its node's rings, says which rank holds the others up
and where (out of band: the hung process group is never used), and only then tears the ranks down.

[Note: a stopped rank is resumed for the teardown] A rank stopped by SIGSTOP (a debugger, a
suspended job, the fault injection tests) cannot act on the SIGTERM the agent sends at teardown,
so the agent would wait its 30 s shutdown timeout before SIGKILL. Once the report has named it, it
is sent SIGCONT, after which the SIGTERM ends it at once.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

_SHARED_MEMORY = Path("/dev/shm")


SNAPSHOT_DIR_ENV = "SLIPSTREAM_SNAPSHOT_DIR"  # read by the engine's checkpoint manager (checkpoint.in_memory_interval)


@contextlib.contextmanager
def run_directory(run_id: str) -> Iterator[Path]:
    """This launch's directory on /dev/shm (the temporary directory without one), removed when the launch ends.

    It holds ``flight/`` (the ranks' rings, exported as ``SLIPSTREAM_FLIGHT_DIR``) and ``snapshots/``
    (``SLIPSTREAM_SNAPSHOT_DIR``): both outlive a rank and the agent's restarts, not the launch.
    Variables the user exported already are kept: a scheduler may want the rings elsewhere.
    Yields the flight directory.
    """
    from slipstream.utils.flight_record import FLIGHT_DIR_ENV

    base = _SHARED_MEMORY if _SHARED_MEMORY.is_dir() and os.access(_SHARED_MEMORY, os.W_OK) else None
    root = Path(tempfile.mkdtemp(prefix=f"slipstream_run_{run_id[:8]}_", dir=base))
    exported = {
        key: str(root / name)
        for key, name in ((FLIGHT_DIR_ENV, "flight"), (SNAPSHOT_DIR_ENV, "snapshots"))
        if key not in os.environ
    }
    os.environ.update(exported)
    try:
        yield Path(os.environ[FLIGHT_DIR_ENV])
    finally:
        for key in exported:
            del os.environ[key]
        shutil.rmtree(root, ignore_errors=True)


def exit_description(exitcode: int) -> str:
    """``killed by signal SIGKILL`` or ``exited with code 1``."""
    if exitcode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by signal {signal.Signals(-exitcode).name}"
        return f"killed by signal number {-exitcode}"
    return f"exited with code {exitcode}"


def report_failed_attempt(directory: Path, attempt: int, world: int, exited: dict[int, str]) -> list[str]:
    """Lines naming the rank that failed or holds the others up (empty when no ring was written)."""
    from slipstream.utils import flight_analysis, flight_record  # torch-free: the agent reads the rings itself

    rings = flight_record.read_rings(directory, attempt)
    if not rings:
        return []
    report = flight_analysis.analyze(rings, world, exited=exited)
    for ring in rings.values():
        if flight_record.process_state(ring.pid).startswith("stopped"):
            with contextlib.suppress(OSError):
                os.kill(ring.pid, signal.SIGCONT)
    return [f"flight recorder: {report.summary}", *(f"    | {line}" for line in report.details)]
