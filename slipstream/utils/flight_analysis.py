"""The flight recorder's analysis: which rank is behind, diverged or gone, from the rings of ``flight_record``.

Imports no torch: the launcher's agent analyses its node's rings when a rank fails
(``launcher/flight_report.py``), a rank whose collective timed out does it in ``comm/flight.py``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable

from slipstream.utils.flight_record import RankFlight, process_state


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
