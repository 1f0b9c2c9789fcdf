"""The flight recorder's record format: each rank's last collectives, kept where the other processes can read them.

A hang's usual trace is one watchdog line per surviving rank ("timed out waiting for all_reduce")
that names neither the rank that is missing nor where it is. So every collective slipstream
issues is written, as it is issued and again when it completes, into a small ring of fixed-size
records (group, op, the group's sequence number, shape, dtype, bytes, step, issued/completed).

[Note: why a memory-mapped file] Under ``slipstream run`` the ring lives in a file of the
launcher's flight directory (``SLIPSTREAM_FLIGHT_DIR``, on ``/dev/shm`` where it exists), mapped
into the rank's memory: a record costs a ``struct.pack_into`` (microseconds, no system call, no
thread, no collective), and it is still readable when the rank is stopped (SIGSTOP), spinning
in native code, or dead (SIGKILL). The report is then made out of band, never over the hung
group: by any rank whose collective timed out (it reads its node's rings) and by the per-node
agent when a rank fails. Without the launcher the ring is an anonymous map: a rank still names
its own position.

This module and its analysis (``flight_analysis.py``) import no torch, so the launcher reads and
analyses the rings without it; ``comm/flight.py`` keeps this process's recorder and the exchange.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import struct
import time
from collections.abc import Sequence
from pathlib import Path

FLIGHT_DIR_ENV = "SLIPSTREAM_FLIGHT_DIR"
CAPACITY = 512  # records per rank: a ZeRO-3 step of a small model issues ~100 collectives
_MAGIC = b"SLPFLT01"
_HEADER = struct.Struct("<8sIIIIdd")  # magic, rank, world, pid, capacity, started, last write
_HEADER_SIZE = 64
# index (1-based issue count; 0: empty), group sequence number, step, issued at, completed at,
# bytes, state, op, group, shape, tag
_RECORD = struct.Struct("<QIIddQB15s48s40s40s")
ISSUED, COMPLETED, FAILED = 1, 2, 3
_STATES = {ISSUED: "issued", COMPLETED: "completed", FAILED: "failed"}


def _text(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode("utf-8", "replace")


def _fit(text: str, size: int) -> bytes:
    data = text.encode("utf-8", "replace")
    return data if len(data) <= size else data[: size - 3] + b"..."


def group_label(ranks: Sequence[int] | None) -> str:
    """``world``, or the member ranks as ranges (``ranks 0-3,8``), the same string on every member."""
    if ranks is None:
        return "world"
    spans: list[str] = []
    ordered = sorted(ranks)
    start = prev = ordered[0]
    for r in [*ordered[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return "ranks " + ",".join(spans)


def ring_path(directory: str | Path, attempt: int | str, rank: int) -> Path:
    return Path(directory) / f"attempt{attempt}" / f"rank{rank:05d}.flight"


class FlightRecorder:
    """This rank's ring of collective records (see the module note)."""

    def __init__(self, rank: int, world: int, path: Path | None = None, capacity: int = CAPACITY) -> None:
        self.rank, self.world, self.capacity, self.path = rank, world, capacity, path
        size = _HEADER_SIZE + capacity * _RECORD.size
        if path is None:
            self._map = mmap.mmap(-1, size)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, size)
                self._map = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        self._issued = 0
        self._sequence: dict[str, int] = {}
        now = time.time()
        _HEADER.pack_into(self._map, 0, _MAGIC, rank, world, os.getpid(), capacity, now, now)

    def issue(self, op: str, group: str, nbytes: int, shape: str, tag: str, step: int) -> int:
        """Record a collective as issued; the returned slot is handed to :meth:`finish`."""
        self._issued += 1
        seq = self._sequence[group] = self._sequence.get(group, 0) + 1
        slot = (self._issued - 1) % self.capacity
        now = time.time()
        _RECORD.pack_into(
            self._map,
            _HEADER_SIZE + slot * _RECORD.size,
            self._issued,
            seq,
            step,
            now,
            0.0,
            nbytes,
            ISSUED,
            _fit(op, 15),
            _fit(group, 48),
            _fit(shape, 40),
            _fit(tag, 40),
        )
        struct.pack_into("<d", self._map, 32, now)
        return self._issued

    def finish(self, index: int, ok: bool = True) -> None:
        """Mark record ``index`` completed (or failed), unless the ring has wrapped over it."""
        if self._issued - index >= self.capacity:
            return
        offset = _HEADER_SIZE + (index - 1) % self.capacity * _RECORD.size
        now = time.time()
        struct.pack_into("<d", self._map, offset + 24, now)  # completed at
        struct.pack_into("<B", self._map, offset + 40, COMPLETED if ok else FAILED)  # state
        struct.pack_into("<d", self._map, 32, now)

    def snapshot(self) -> RankFlight:
        return parse_ring(bytes(self._map))  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------- reading


@dataclasses.dataclass(frozen=True)
class Record:
    index: int
    seq: int
    step: int
    issued_at: float
    completed_at: float
    nbytes: int
    state: str
    op: str
    group: str
    shape: str
    tag: str

    @property
    def p2p(self) -> bool:
        """Point-to-point transfers pair by channel, not by order: they are left out of the order comparison."""
        return self.op.startswith("p2p")

    def signature(self) -> tuple[str, str]:
        return self.op, self.shape

    def describe(self) -> str:
        tag = f" '{self.tag}'" if self.tag else ""
        return f"{self.op} #{self.seq} of {self.group} ({self.shape}{tag}, step {self.step})"


@dataclasses.dataclass
class RankFlight:
    rank: int
    world: int
    pid: int
    started: float
    last_write: float
    records: list[Record]  # in issue order

    def in_group(self, group: str) -> dict[int, Record]:
        return {r.seq: r for r in self.records if r.group == group}

    def last_seq(self, group: str) -> int:
        return max((r.seq for r in self.records if r.group == group), default=0)

    def pending(self) -> Record | None:
        """The oldest collective issued and not completed: where this rank waits.

        One whose group has completed a later collective is not waited on (a handle dropped without
        ``wait()``): a group runs its collectives in order, so it finished too."""
        done: dict[str, int] = {}
        for r in self.records:
            if r.state == "completed":
                done[r.group] = max(done.get(r.group, 0), r.seq)
        return next((r for r in self.records if r.state != "completed" and r.seq > done.get(r.group, 0)), None)


def parse_ring(data: bytes) -> RankFlight | None:
    """A ring's bytes (its file, or what a rank published to the store) as records; None for what is not one."""
    if len(data) < _HEADER_SIZE or data[:8] != _MAGIC:
        return None
    _, rank, world, pid, capacity, started, last_write = _HEADER.unpack_from(data, 0)
    records = []
    for slot in range(min(capacity, (len(data) - _HEADER_SIZE) // _RECORD.size)):
        fields = _RECORD.unpack_from(data, _HEADER_SIZE + slot * _RECORD.size)
        if fields[0] == 0:
            continue
        index, seq, step, issued, completed, nbytes, state, op, group, shape, tag = fields
        records.append(
            Record(
                index,
                seq,
                step,
                issued,
                completed,
                nbytes,
                _STATES.get(state, "?"),
                _text(op),
                _text(group),
                _text(shape),
                _text(tag),
            )
        )
    records.sort(key=lambda r: r.index)
    return RankFlight(rank, world, pid, started, last_write, records)


def read_rings(directory: str | Path, attempt: int | str) -> dict[int, RankFlight]:
    """Every ring of one attempt in ``directory`` (this node's ranks), by rank; unreadable files are skipped."""
    found: dict[int, RankFlight] = {}
    for path in sorted((Path(directory) / f"attempt{attempt}").glob("rank*.flight")):
        try:
            flight = parse_ring(path.read_bytes())
        except OSError:
            continue
        if flight is not None:
            found[flight.rank] = flight
    return found


def process_state(pid: int) -> str:
    """What the kernel says of ``pid`` on this machine: running, sleeping, stopped, exited..."""
    if not Path("/proc/self/stat").exists():  # not Linux: no kernel view to ask
        return "state unknown"
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "exited"
    code = stat.rsplit(")", 1)[-1].split()[0]
    return {
        "R": "running",
        "S": "waiting",
        "D": "in uninterruptible I/O",
        "T": "stopped (SIGSTOP)",
        "t": "stopped by a debugger",
        "Z": "exited (not yet reaped)",
        "X": "exited",
    }.get(code, f"state {code}")
