"""A per-step record of every collective: op, bytes, time, group. Tests, benchmarks and the step record read it."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import torch.distributed as dist

from slipstream.comm.topology import link_class

# Bytes each rank moves per byte of tensor, in the ZeRO paper's accounting: an all-reduce is a
# reduce-scatter plus an all-gather.
TRAFFIC_FACTOR = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "broadcast": 1}


@dataclasses.dataclass
class CommRecord:
    op: str
    nbytes: int  # the full (unsharded) tensor the collective is about
    tag: str
    seconds: float | None = None  # launch to completion, filled when the work is waited on
    ranks: tuple[int, ...] | None = None  # the group's global ranks; None: the default (world) group

    @property
    def moved(self) -> int:
        return self.nbytes * TRAFFIC_FACTOR.get(self.op, 1)


class CommsLog:
    """Collectives issued since the last :meth:`next_step`; cheap enough to leave always on."""

    def __init__(self) -> None:
        self.step = 0
        self.records: list[CommRecord] = []
        self.last: list[CommRecord] = []  # the previous step's records (the step monitor reports them)
        self.history: list[list[CommRecord]] = []
        self.keep_history = 0  # how many finished steps to keep (benchmarks ask for some)
        self._group_ranks: dict[Any, tuple[int, ...]] = {}

    def add(self, op: str, nbytes: int, tag: str, group: Any = None) -> CommRecord:
        record = CommRecord(op, nbytes, tag, ranks=self._ranks_of(group))
        self.records.append(record)
        return record

    def _ranks_of(self, group: Any) -> tuple[int, ...] | None:
        """The global ranks of ``group`` (looked up once per group: the monitor attributes traffic to mesh axes)."""
        if group is None or group is dist.group.WORLD:
            return None
        found = self._group_ranks.get(group)
        if found is None:
            found = self._group_ranks[group] = tuple(dist.get_process_group_ranks(group))
        return found

    def next_step(self) -> None:
        if self.keep_history:
            self.history.append(self.records)
            del self.history[: -self.keep_history]
        self.last = self.records
        self.records = []
        self.step += 1

    def counts(self) -> Counter[str]:
        return Counter(r.op for r in self.records)

    def bytes_by_op(self) -> Counter[str]:
        totals: Counter[str] = Counter()
        for r in self.records:
            totals[r.op] += r.nbytes
        return totals

    def bytes_by_link(self, records: list[CommRecord] | None = None) -> Counter[str]:
        """Bytes moved per rank on each link class (``topology.INTRA`` / ``INTER``): a collective counts on the
        inter-node links when its group spans nodes. ``records``: another step's (default: this one's)."""
        totals: Counter[str] = Counter()
        for r in self.records if records is None else records:
            totals[link_class(r.ranks)] += r.moved
        return totals

    def moved_bytes(self) -> int:
        """Bytes moved per rank this step (all-reduce counts twice: reduce-scatter + all-gather)."""
        return sum(r.moved for r in self.records)

    def summary(self) -> str:
        parts = []
        for op, count in sorted(self.counts().items()):
            nbytes = self.bytes_by_op()[op]
            seconds = sum(r.seconds or 0.0 for r in self.records if r.op == op)
            parts.append(f"{op}: {count} calls, {nbytes / 2**20:.2f} MiB, {seconds * 1e3:.1f} ms")
        return f"step {self.step} comms: " + ("; ".join(parts) if parts else "none")
