"""The flight recorder: each rank's last collectives, kept where the other processes can read them.

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

This module imports no torch, so the launcher can read and analyse the rings.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import struct
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

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
        return _parse(bytes(self._map))  # type: ignore[return-value]


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


def _parse(data: bytes) -> RankFlight | None:
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
            flight = _parse(path.read_bytes())
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


# ---------------------------------------------------------------------------------------------- analysis


@dataclasses.dataclass
class HangReport:
    """What the rings say: the rank(s) to blame and why, in one summary line plus detail lines."""

    culprits: list[int]
    summary: str
    details: list[str]

    def lines(self) -> list[str]:
        return [self.summary, *self.details]


def _ranks(ranks: Iterable[int]) -> str:
    ordered = sorted(ranks)
    return f"rank {ordered[0]}" if len(ordered) == 1 else "ranks " + ",".join(map(str, ordered))


def _members(group: str, world: int) -> list[int]:
    if group == "world":
        return list(range(world))
    members: list[int] = []
    for span in group.removeprefix("ranks ").split(","):
        low, _, high = span.partition("-")
        members.extend(range(int(low), int(high or low) + 1))
    return members


def first_divergence(flights: dict[int, RankFlight]) -> tuple[str, int, dict[tuple[str, str], list[int]], int] | None:
    """The earliest (step, group, sequence number) at which ranks issued different collectives.

    Returns (group, seq, {(op, shape): ranks}, step) or None. Only sequence numbers that every
    compared rank still holds in its ring are compared.
    """
    groups = {r.group for f in flights.values() for r in f.records if not r.p2p}
    best: tuple[int, float, str, int, dict[tuple[str, str], list[int]]] | None = None
    for group in groups:
        by_rank = {rank: f.in_group(group) for rank, f in flights.items()}
        by_rank = {rank: seqs for rank, seqs in by_rank.items() if seqs}
        if len(by_rank) < 2:
            continue
        common = set.intersection(*(set(seqs) for seqs in by_rank.values()))
        for seq in sorted(common):
            kinds: dict[tuple[str, str], list[int]] = {}
            for rank, seqs in by_rank.items():
                kinds.setdefault(seqs[seq].signature(), []).append(rank)
            if len(kinds) > 1:
                record = next(iter(by_rank.values()))[seq]
                key = (record.step, record.issued_at, group, seq, kinds)
                if best is None or key[:2] < best[:2]:
                    best = key
                break
    if best is None:
        return None
    step, _, group, seq, kinds = best
    return group, seq, kinds, step


def analyze(
    flights: dict[int, RankFlight],
    world: int,
    now: float | None = None,
    exited: dict[int, str] | None = None,
    unanswered: Iterable[int] = (),
) -> HangReport:
    """Name the rank that holds the others up, from the rings of (ideally) every rank.

    ``exited`` adds what the launcher knows of ranks that are gone ("killed by signal SIGKILL");
    ``unanswered`` are ranks asked for their ring out of band that did not answer in time.
    The order of the questions: did ranks take different paths (a divergence is the cause of any
    hang that follows it)? Is a rank behind its group in the collective the others wait in? Else
    say where each rank waits.
    """
    now = time.time() if now is None else now
    exited = exited or {}
    silent = set(unanswered) - set(flights)
    details: list[str] = []

    def whereabouts(rank: int) -> str:
        flight = flights.get(rank)
        if flight is None:
            return exited.get(rank, "did not answer" if rank in silent else "no flight record on this node")
        state = exited.get(rank) or process_state(flight.pid)
        last = flight.records[-1] if flight.records else None
        where = f"last collective {last.describe()}, {last.state}" if last else "no collective issued yet"
        return f"{state}; {where}; last record {max(0.0, now - flight.last_write):.1f} s ago"

    diverged = first_divergence(flights)
    if diverged is not None:
        group, seq, kinds, step = diverged
        parts = sorted(kinds.items(), key=lambda item: (len(item[1]), item[1]))
        majority = len(parts) > 1 and len(parts[-1][1]) > len(parts[-2][1])  # one side strictly largest
        culprits = [r for _, ranks in (parts[:-1] if majority else parts) for r in ranks]
        sides = "; ".join(f"{_ranks(ranks)} issued {op} ({shape})" for (op, shape), ranks in parts)
        who = (
            f"{_ranks(culprits)} took a different code path"
            if majority
            else f"{_ranks(culprits)} disagree (no majority)"
        )
        summary = f"{who}: the first divergence is collective #{seq} of {group} in step {step}: {sides}"
        details += [f"rank {r}: {whereabouts(r)}" for r in sorted(set(range(world)) | set(flights))]
        return HangReport(sorted(culprits), summary, details)

    waiting = {rank: f.pending() for rank, f in flights.items()}
    waiting = {rank: record for rank, record in waiting.items() if record is not None and not record.p2p}
    for rank, record in sorted(waiting.items(), key=lambda item: item[1].issued_at):
        members = _members(record.group, world)
        behind = [m for m in members if m in flights and flights[m].last_seq(record.group) < record.seq]
        # [Note: gone before slow] On a loaded machine a live rank may simply not have reached the collective yet
        # when the rings are read; if some of the ranks behind are gone or stopped, they are the cause, and the
        # ones still working are listed among the details, not blamed.
        held = [m for m in behind if m in exited or process_state(flights[m].pid).startswith(("exited", "stopped"))]
        behind = held or behind
        waiters = [r for r, other in waiting.items() if other.group == record.group and other.seq == record.seq]
        if not behind:
            quiet = [m for m in members if m in silent]
            unseen = [m for m in members if m not in flights and m not in exited and m not in silent]
            if quiet:  # every rank that could answer is waiting here: the silent ones are the suspects
                summary = (
                    f"{_ranks(quiet)} did not answer (stopped, dead, or busy outside slipstream's collectives) while "
                    f"{_ranks(waiters)} {'waits' if len(waiters) == 1 else 'wait'} in {record.describe()} for "
                    f"{now - record.issued_at:.1f} s"
                )
                details += [f"rank {r}: {whereabouts(r)}" for r in sorted(set(flights))]
                return HangReport(sorted(quiet), summary, details)
            if unseen:
                details.append(
                    f"rank {rank} waits in {record.describe()}; {_ranks(unseen)} of the group have no record here"
                )
            continue
        summary = (
            f"{_ranks(behind)} {'is' if len(behind) == 1 else 'are'} behind: {_ranks(waiters)} "
            f"{'waits' if len(waiters) == 1 else 'wait'} in {record.describe()} for {now - record.issued_at:.1f} s, "
            f"which {_ranks(behind)} never issued ({'; '.join(f'rank {b}: {whereabouts(b)}' for b in behind)})"
        )
        details += [f"rank {r}: {whereabouts(r)}" for r in sorted(set(members) - set(behind))]
        return HangReport(sorted(behind), summary, details)

    gone = sorted(exited)
    if gone:
        summary = "; ".join(f"rank {r} {exited[r]}: {whereabouts(r).split('; ', 1)[-1]}" for r in gone)
        details += [f"rank {r}: {whereabouts(r)}" for r in sorted(set(flights) - set(gone))]
        return HangReport(gone, summary, details)
    if waiting:
        rank, record = min(waiting.items(), key=lambda item: item[1].issued_at)
        members = _members(record.group, world)
        if any(m not in flights for m in members):
            summary = (
                f"{_ranks(waiting)} {'waits' if len(waiting) == 1 else 'wait'} in {record.describe()}; the rings of "
                f"{_ranks(m for m in members if m not in flights)} are not visible from here"
            )
        else:
            summary = (
                f"every member of {record.group} issued {record.describe()} and none completed it: no rank is behind "
                f"in slipstream's collectives (a transport failure, or a collective issued outside slipstream)"
            )
    else:
        summary = "no rank waits in a collective slipstream issued"
    details += [f"rank {r}: {whereabouts(r)}" for r in sorted(flights)]
    return HangReport([], summary, details)


# ---------------------------------------------------------------------------------------------- this process


_recorder: FlightRecorder | None = None
_generation = 0  # bumped by reset(): the out-of-band keys of one run never mix with an earlier one's


def reset() -> None:
    """Start a fresh recorder, as a new process would (for harnesses that reuse processes across jobs; on every rank)."""
    global _recorder, _last_report, _generation
    _recorder, _last_report = None, None
    _generation += 1


def recorder(rank: int, world: int) -> FlightRecorder:
    """This process's recorder: in the launcher's flight directory when there is one (one per process and attempt)."""
    global _recorder
    if _recorder is None or (_recorder.rank, _recorder.world) != (rank, world):
        directory = os.environ.get(FLIGHT_DIR_ENV)
        path = ring_path(directory, os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), rank) if directory else None
        try:
            _recorder = FlightRecorder(rank, world, path)
        except OSError:  # a full /dev/shm must not stop training: keep the ring in private memory
            _recorder = FlightRecorder(rank, world, None)
    return _recorder


_STORE_PREFIX = "slipstream_flight/"
_last_report: tuple[int, HangReport] | None = None  # (collectives issued when it was made, the report)


def report_for(rank: int, world: int, store: Any = None, wait_s: float = 0.0) -> HangReport:
    """Analyse the rings this rank can get: its node's (under the launcher) and, through ``store``, the others'.

    [Note: the out-of-band exchange] ``store`` is the job's key-value store (torch's TCPStore, never
    the hung process group): this rank publishes its ring there and waits up to ``wait_s`` for the
    rings of the ranks it cannot read from its node's directory. The other ranks whose collectives
    time out publish theirs the same way; a rank that is stopped, dead or computing never does,
    and is named as not answering.
    """
    global _last_report
    own = recorder(rank, world)
    if (
        _last_report is not None and _last_report[0] == own._issued
    ):  # the works queued behind a failed one: one exchange serves all
        return _last_report[1]
    directory = os.environ.get(FLIGHT_DIR_ENV)
    flights = read_rings(directory, os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) if directory else {}
    flights[rank] = own.snapshot()
    unanswered: set[int] = set()
    if store is not None and world > 1:
        unanswered = _exchange(store, rank, world, bytes(own._map), flights, wait_s)
    report = analyze(flights, world, unanswered=unanswered)
    _last_report = (own._issued, report)
    return report


def _exchange(
    store: Any, rank: int, world: int, ring: bytes, flights: dict[int, RankFlight], wait_s: float
) -> set[int]:
    """Publish ``ring``; add the other ranks' published rings to ``flights``; return the ranks that stayed silent."""
    store.set(f"{_STORE_PREFIX}{_generation}/{rank}", ring)
    missing = set(range(world)) - set(flights)
    deadline = time.monotonic() + wait_s
    while missing:
        for other in sorted(missing):
            key = f"{_STORE_PREFIX}{_generation}/{other}"
            if store.check([key]):
                parsed = _parse(store.get(key))
                if parsed is not None:
                    flights[other] = parsed
                missing.discard(other)
        if not missing or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    return missing
