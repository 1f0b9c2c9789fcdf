"""Which rank is slow, and which rank's loss went non-finite first: named in the log instead of guessed.

[Note: why the monitor names ranks] In synchronous training one slow rank makes every rank slow: the
others wait for it in the gradient reduction, so the progress line's step time is the same on every
rank and cannot say who. A NaN on one rank reaches every rank through that same reduction one step
later, so rank 0's line shows ``loss nan`` without saying where it started. Each rank therefore
measures its *own* time (wall time minus the time it waited for its peers in the gradient reduction,
see :class:`WaitClock`) and remembers the first step its local loss was non-finite; at each progress
line one ``all_gather`` of three float64 per rank brings both to rank 0, which names the rank.
Nothing is exchanged on other steps, nor on one process; the loss check costs no device
synchronization (a few device ops per optimizer step, read at the progress line's exchange).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from slipstream import comm
from slipstream.engine.monitor.timers import Timers

# A rank is slow when its own mean step time over a progress-line window exceeds the median of the
# other ranks' by more than this fraction (0.2: 20%) ...
SLOW_MARGIN = 0.2
# ... and by more than this many seconds (scheduling jitter on millisecond steps is not a slow rank) ...
SLOW_MIN_EXCESS_S = 0.005
# ... at this many consecutive progress lines (one slow window is a hiccup: a checkpoint, a page fault).
SLOW_REPORTS = 2
# Timers whose time is spent waiting for other ranks, not working (the runner's gradient reduction).
WAIT_TIMERS = frozenset({"reduce"})


class WaitClock(Timers):
    """The monitor's timers, which also clock the host time spent in :data:`WAIT_TIMERS` (read by :class:`RankHealth`).

    Without ``wall_clock_breakdown`` this is host time and synchronizes nothing: true for gloo, whose
    waits block the host; with an accelerator's asynchronous collectives the wait shows up later (at a
    synchronization) and slowness is then seen only with ``wall_clock_breakdown``, whose synchronizing
    timers put the wait for the peers back inside the reduction.
    """

    def __init__(self, enabled: bool, synchronize: Callable[[], None] | None = None) -> None:
        super().__init__(enabled, synchronize)
        self.waited = 0.0  # seconds in WAIT_TIMERS since the last take_waited()

    def __call__(self, name: str) -> contextlib.AbstractContextManager[None]:
        return self._waited(name) if name in WAIT_TIMERS else super().__call__(name)

    @contextlib.contextmanager
    def _waited(self, name: str) -> Iterator[None]:
        before = self._totals.get(name, 0.0) if self.enabled else time.perf_counter()
        with super().__call__(name):
            yield
        # Enabled: the timer's own interval, which excludes the synchronization (own work) before it.
        self.waited += (self._totals.get(name, 0.0) - before) if self.enabled else time.perf_counter() - before

    def take_waited(self) -> float:
        waited, self.waited = self.waited, 0.0
        return waited


@dataclasses.dataclass(frozen=True)
class SlowRank:
    rank: int
    seconds: float  # its mean step time over the last window (without waiting for its peers)
    median: float  # the median of the other ranks' over the same window
    reports: int  # consecutive progress lines it was slow at

    def describe(self) -> str:
        return (
            f"rank {self.rank} is slow: {self.seconds / self.median:.2f}x the median step time "
            f"({self.seconds * 1e3:.0f} ms vs {self.median * 1e3:.0f} ms) for the last {self.reports} reports"
        )


@dataclasses.dataclass(frozen=True)
class NonFinite:
    """The run's first non-finite symptom: a rank's local loss, or the (global) gradient norm before any."""

    step: int  # the optimizer step (as the progress line counts) of the first symptom
    source: str  # "loss" or "gradient norm"
    loss_step: int | None  # the lowest step with a non-finite local loss; None: none so far
    ranks: tuple[int, ...] = ()  # the ranks whose local loss was non-finite at loss_step
    losses: tuple[float, ...] = ()  # their mean loss over that step's micro-batches

    def key(self) -> tuple[object, ...]:
        """What identifies the verdict (the losses are NaN, which equals nothing)."""
        return self.step, self.source, self.loss_step, self.ranks

    def describe(self, reported_at: int) -> str:
        values = {f"{v:g}" for v in self.losses}
        value = (
            next(iter(values))
            if len(values) == 1
            else ", ".join(f"{v:g} on rank {r}" for r, v in zip(self.ranks, self.losses))
        )
        loss = f"at step {self.loss_step} on rank(s) {', '.join(map(str, self.ranks))} (loss {value})"
        if self.source == "loss":
            return f"non-finite loss first {loss}"
        first = f"was {loss}" if self.loss_step is not None else f"not yet seen (no rank's up to step {reported_at})"
        return f"non-finite gradient norm at step {self.step} (all ranks agree: it is global); the first non-finite local loss {first}"


def over_median(
    seconds: Sequence[float], margin: float = SLOW_MARGIN, min_excess: float = SLOW_MIN_EXCESS_S
) -> dict[int, float]:
    """Rank → the median of the others, for each rank whose time exceeds that median by more than ``margin`` and ``min_excess``."""
    found = {}
    for rank, own in enumerate(seconds):
        others = [s for r, s in enumerate(seconds) if r != rank]
        median = statistics.median(others) if others else 0.0
        if median > 0 and own > median * (1 + margin) and own - median > min_excess:
            found[rank] = median
    return found


class RankHealth:
    """Every rank feeds it each optimizer step; at progress lines it exchanges once and says what to log (rank 0 logs).

    ``slow_ranks`` and ``first_nonfinite`` hold the verdict of the last exchange (the same on every rank).
    """

    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank, self.device = rank, device
        self.slow_ranks: dict[int, SlowRank] = {}
        self.first_nonfinite: NonFinite | None = None
        self._streaks: dict[int, int] = {}
        self._steps, self._waited, self._start = 0, 0.0, time.perf_counter()
        self._loss_first: torch.Tensor | None = None  # on the loss's device: (step, mean loss), step nan: none yet
        # on the norm's device: the first step of a non-finite norm, or nan
        self._grad_first: torch.Tensor | None = None

    def on_step(
        self,
        step: int,
        loss_sum: torch.Tensor | None,
        losses: int,
        grad_norm: float | torch.Tensor | None,
        dynamic_scale: bool,
        waited: float,
    ) -> None:
        """One optimizer step: ``loss_sum`` over ``losses`` micro-batches, kept on its device (no synchronization)."""
        self._steps += 1
        self._waited += waited
        if loss_sum is not None and losses:
            mean = loss_sum.detach().double() / losses
            if self._loss_first is None:
                self._loss_first = torch.full((2,), math.nan, dtype=torch.float64, device=mean.device)
            fresh = torch.isnan(self._loss_first[0]) & ~torch.isfinite(mean)
            self._loss_first = torch.where(fresh, torch.stack((torch.full_like(mean, step), mean)), self._loss_first)
        # dynamic loss scaling overflows by design: a skipped step there is the scale search, not a symptom
        if grad_norm is None or dynamic_scale:
            return
        if isinstance(grad_norm, torch.Tensor):  # kept on the norm's device, as the loss (it was never read)
            if self._grad_first is None:
                self._grad_first = torch.full((), math.nan, dtype=torch.float64, device=grad_norm.device)
            fresh = torch.isnan(self._grad_first) & ~torch.isfinite(grad_norm)
            self._grad_first = torch.where(fresh, torch.full_like(self._grad_first, step), self._grad_first)
        elif not math.isfinite(grad_norm) and (self._grad_first is None or math.isnan(float(self._grad_first))):
            self._grad_first = torch.tensor(float(step), dtype=torch.float64)

    def exchange(self, step: int) -> list[tuple[int, str]]:
        """At a progress line, on every rank: one all_gather (none on one process); the lines to log (level, text)."""
        own = max(time.perf_counter() - self._start - self._waited, 0.0) / max(self._steps, 1)
        first = self._loss_first if self._loss_first is not None else torch.full((2,), math.nan, dtype=torch.float64)
        payload = torch.cat((torch.tensor([own], dtype=torch.float64, device=self.device), first.to(self.device)))
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered = payload.new_empty(dist.get_world_size() * payload.numel())
            comm.all_gather_into_tensor(gathered, payload, tag="rank health").wait()
            rows = gathered.view(-1, payload.numel()).tolist()
        else:
            rows = [payload.tolist()]
        verdicts = [*self._judge_speed([row[0] for row in rows]), *self._judge_numerics(rows, step)]
        self._steps, self._waited, self._start = 0, 0.0, time.perf_counter()
        return verdicts

    def _judge_speed(self, seconds: list[float]) -> list[tuple[int, str]]:
        flagged = over_median(seconds)
        self._streaks = {r: self._streaks.get(r, 0) + 1 for r in flagged}
        self.slow_ranks = {
            r: SlowRank(r, seconds[r], flagged[r], n) for r, n in sorted(self._streaks.items()) if n >= SLOW_REPORTS
        }
        return [(logging.WARNING, "; ".join(s.describe() for s in self.slow_ranks.values()))] if self.slow_ranks else []

    def _judge_numerics(self, rows: list[list[float]], step: int) -> list[tuple[int, str]]:
        bad = {r: (int(row[1]), row[2]) for r, row in enumerate(rows) if not math.isnan(row[1])}
        loss_step = min((s for s, _ in bad.values()), default=None)
        ranks = tuple(r for r, (s, _) in sorted(bad.items()) if s == loss_step)
        losses = tuple(bad[r][1] for r in ranks)
        grad_first = math.nan if self._grad_first is None else float(self._grad_first)
        grad_step = None if math.isnan(grad_first) else int(grad_first)
        if grad_step is not None and (loss_step is None or grad_step < loss_step):
            verdict = NonFinite(grad_step, "gradient norm", loss_step, ranks, losses)
        elif loss_step is not None:
            verdict = NonFinite(loss_step, "loss", loss_step, ranks, losses)
        else:
            return []
        if self.first_nonfinite is not None and verdict.key() == self.first_nonfinite.key():
            return []  # logged once per first occurrence
        self.first_nonfinite = verdict
        return [(logging.ERROR, verdict.describe(step))]
