"""This process's flight recorder, and the hang report a rank makes when its collective times out.

The ring format is ``utils/flight_record.py`` and its analysis ``utils/flight_analysis.py`` (both
torch-free, so the launcher reads them too); what this process keeps between calls (its recorder,
the run's generation, the last report) is comm's state ([Note: one owner of comm's state]).
"""

from __future__ import annotations

import os
import time
from typing import Any

from slipstream.comm.process import PROCESS
from slipstream.utils.flight_analysis import HangReport, analyze
from slipstream.utils.flight_record import FLIGHT_DIR_ENV, FlightRecorder, RankFlight, parse_ring, read_rings, ring_path


def reset() -> None:
    """Start a fresh recorder, as a new process would (for harnesses that reuse processes across jobs; on every rank)."""
    PROCESS.recorder, PROCESS.last_report = None, None
    PROCESS.generation += 1  # the out-of-band keys of one run never mix with an earlier one's


def recorder(rank: int, world: int) -> FlightRecorder:
    """This process's recorder: in the launcher's flight directory when there is one (one per process and attempt)."""
    current: FlightRecorder | None = PROCESS.recorder
    if current is None or (current.rank, current.world) != (rank, world):
        directory = os.environ.get(FLIGHT_DIR_ENV)
        path = ring_path(directory, os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), rank) if directory else None
        try:
            current = PROCESS.recorder = FlightRecorder(rank, world, path)
        except OSError:  # a full /dev/shm must not stop training: keep the ring in private memory
            current = PROCESS.recorder = FlightRecorder(rank, world, None)
    return current


_STORE_PREFIX = "slipstream_flight/"


def report_for(rank: int, world: int, store: Any = None, wait_s: float = 0.0) -> HangReport:
    """Analyse the rings this rank can get: its node's (under the launcher) and, through ``store``, the others'.

    [Note: the out-of-band exchange] ``store`` is the job's key-value store (torch's TCPStore, never
    the hung process group): this rank publishes its ring there and waits up to ``wait_s`` for the
    rings of the ranks it cannot read from its node's directory. The other ranks whose collectives
    time out publish theirs the same way; a rank that is stopped, dead or computing never does,
    and is named as not answering.
    """
    own = recorder(rank, world)
    if (
        PROCESS.last_report is not None and PROCESS.last_report[0] == own._issued
    ):  # the works queued behind a failed one: one exchange serves all
        return PROCESS.last_report[1]
    directory = os.environ.get(FLIGHT_DIR_ENV)
    flights = read_rings(directory, os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) if directory else {}
    flights[rank] = own.snapshot()
    unanswered: set[int] = set()
    if store is not None and world > 1:
        unanswered = _exchange(store, rank, world, bytes(own._map), flights, wait_s)
    report = analyze(flights, world, unanswered=unanswered)
    PROCESS.last_report = (own._issued, report)  # (collectives issued when it was made, the report)
    return report


def _exchange(
    store: Any, rank: int, world: int, ring: bytes, flights: dict[int, RankFlight], wait_s: float
) -> set[int]:
    """Publish ``ring``; add the other ranks' published rings to ``flights``; return the ranks that stayed silent."""
    store.set(f"{_STORE_PREFIX}{PROCESS.generation}/{rank}", ring)
    missing = set(range(world)) - set(flights)
    deadline = time.monotonic() + wait_s
    while missing:
        for other in sorted(missing):
            key = f"{_STORE_PREFIX}{PROCESS.generation}/{other}"
            if store.check([key]):
                parsed = parse_ring(store.get(key))
                if parsed is not None:
                    flights[other] = parsed
                missing.discard(other)
        if not missing or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    return missing
