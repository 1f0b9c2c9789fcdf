"""Cost a schedule before running it: dependency check, timeline, bubble and activations in flight.

Each rank runs its actions in order, each as soon as the actions it depends on have finished
(a forward needs the previous stage's forward of the same micro-batch; a backward or input
gradient needs this stage's forward and the next stage's backward; a weight gradient needs the
input gradient). Transfers are free here. A schedule whose ranks would wait on each other forever
is refused, naming what each rank waits for: the executor would hang on it.

The bubble is idle time over busy time, ``(makespan - busy) / busy``, so 1F1B's is (p-1)/m with
any costs, and it compares directly with the executor's measurement (``executor.StepTiming``).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping

from slipstream.engine.parallel.pipeline.actions import Action, Op
from slipstream.engine.parallel.pipeline.schedules import Schedule


@dataclasses.dataclass(frozen=True)
class Costs:
    """Time of one pass of one whole rank's share (a stage among v per rank costs 1/v of it)."""

    forward: float = 1.0
    backward_input: float = 1.0
    backward_weight: float = 1.0

    def of(self, op: Op, stages_per_rank: int) -> float:
        full = {
            Op.FORWARD: self.forward,
            Op.BACKWARD_INPUT: self.backward_input,
            Op.BACKWARD_WEIGHT: self.backward_weight,
        }
        cost = full.get(op, self.backward_input + self.backward_weight)
        return cost / stages_per_rank


@dataclasses.dataclass(frozen=True)
class Timeline:
    spans: tuple[tuple[tuple[Action, float, float], ...], ...]  # per rank: (action, start, end)

    @property
    def makespan(self) -> float:
        return max((spans[-1][2] for spans in self.spans if spans), default=0.0)

    def busy(self, rank: int) -> float:
        return sum(end - start for _, start, end in self.spans[rank])

    def bubble(self, rank: int | None = None) -> float:
        """Idle over busy time: of one rank, or the largest over ranks."""
        ranks = range(len(self.spans)) if rank is None else (rank,)
        return max((self.makespan - self.busy(r)) / self.busy(r) for r in ranks)


def dependencies(action: Action, last_stage: int) -> list[Action]:
    s, i = action.stage, action.micro
    if action.op is Op.FORWARD:
        return [Action(s - 1, Op.FORWARD, i)] if s > 0 else []
    if action.op is Op.BACKWARD_WEIGHT:
        return [Action(s, Op.BACKWARD_INPUT, i)]
    deps = [Action(s, Op.FORWARD, i)]
    if s < last_stage:
        deps.append(Action(s + 1, Op.BACKWARD, i))  # or its input-gradient pass: see _done()
    return deps


def check(schedule: Schedule) -> None:
    """Every (stage, micro-batch) has one forward and one backward (or an I and a W), on the stage's rank."""
    layout, m = schedule.layout, schedule.micro_batches
    seen: collections.Counter[tuple[int, str, int]] = collections.Counter()
    for rank, actions in enumerate(schedule.compute):
        for a in actions:
            if layout.rank_of(a.stage) != rank:
                raise ValueError(
                    f"pipeline schedule {schedule.name}: {a} is on rank {rank}, but stage {a.stage} lives on rank {layout.rank_of(a.stage)}"
                )
            seen[a.stage, a.op.value, a.micro] += 1
    for s in range(layout.num_stages):
        for i in range(m):
            full, parts = seen[s, "B", i], (seen[s, "I", i], seen[s, "W", i])
            if seen[s, "F", i] != 1 or not (full == 1 and parts == (0, 0) or full == 0 and parts == (1, 1)):
                raise ValueError(
                    f"pipeline schedule {schedule.name}: stage {s} micro-batch {i} is not run exactly once forward and once backward"
                )


def simulate(schedule: Schedule, costs: Costs | Mapping[int, Costs] = Costs()) -> Timeline:
    """Each rank's actions as early as their dependencies allow.

    ``costs``: one rank's pass costs (each of its v stages costs 1/v of them), or each stage's own
    pass costs (measured: stages that differ, such as the one holding the LM head, are costed as they are).
    """
    check(schedule)
    last = schedule.layout.num_stages - 1
    v = schedule.layout.stages_per_rank
    end: dict[Action, float] = {}
    spans: list[list[tuple[Action, float, float]]] = [[] for _ in schedule.compute]
    cursor = [0] * len(schedule.compute)
    clock = [0.0] * len(schedule.compute)

    def finished(dep: Action) -> float | None:
        if dep.op is Op.BACKWARD:  # the next stage's input gradient, whichever pass made it
            for op in (Op.BACKWARD, Op.BACKWARD_INPUT):
                if (t := end.get(Action(dep.stage, op, dep.micro))) is not None:
                    return t
            return None
        return end.get(dep)

    progress = True
    while progress:
        progress = False
        for rank, actions in enumerate(schedule.compute):
            while cursor[rank] < len(actions):
                action = actions[cursor[rank]]
                ready = [finished(d) for d in dependencies(action, last)]
                if any(t is None for t in ready):
                    break
                start = max([clock[rank], *ready])  # type: ignore[list-item]
                cost = costs.of(action.op, v) if isinstance(costs, Costs) else costs[action.stage].of(action.op, 1)
                clock[rank] = start + cost
                end[action] = clock[rank]
                spans[rank].append((action, start, clock[rank]))
                cursor[rank] += 1
                progress = True
    stuck = [
        f"rank {r} at {actions[cursor[r]]}" for r, actions in enumerate(schedule.compute) if cursor[r] < len(actions)
    ]
    if stuck:
        raise ValueError(f"pipeline schedule {schedule.name} deadlocks: {', '.join(stuck)} wait forever")
    return Timeline(tuple(tuple(s) for s in spans))


def peak_in_flight(schedule: Schedule) -> dict[int, int]:
    """Per stage, the most micro-batches whose forward ran and whose backward has not (activations kept)."""
    peaks: dict[int, int] = {}
    for actions in schedule.compute:
        live: collections.Counter[int] = collections.Counter()
        for a in actions:
            if a.op is Op.FORWARD:
                live[a.stage] += 1
                peaks[a.stage] = max(peaks.get(a.stage, 0), live[a.stage])
            elif a.op in (Op.BACKWARD, Op.BACKWARD_INPUT):
                live[a.stage] -= 1
    return peaks


def predicted_bubble(schedule: Schedule, costs: Costs = Costs()) -> float:
    """The schedule's bubble from its closed form (the papers' tables), for the tests.

    F, B (= I + W) and W are one stage's costs (a rank's costs over v). 1F1B family: (p-1)/(v·m).
    Zero bubble (ZB-H1 = zb1p, ZB-V): idle time (p-1)(F+B-2W), as in the DualPipe paper's table.
    DualPipeV: the table's (PP/2-1)(F&B+B-3W) counts F&B as one overlapped pair, which needs two
    streams on a GPU; executed in turn (F&B = F+B, as here) DualPipeV's action list idles exactly
    as long as ZB-V's, (p-1)(F+B-2W), which is what this returns for it.
    """
    p, m, v = schedule.layout.ranks, schedule.micro_batches, schedule.layout.stages_per_rank
    f, w = costs.forward / v, costs.backward_weight / v
    b = (costs.backward_input + costs.backward_weight) / v
    busy = m * v * (f + b)
    name = schedule.name
    if name in ("afab", "1f1b", "interleaved_1f1b"):
        return (p - 1) / (v * m)
    return (p - 1) * (f + b - 2 * w) / busy  # zbv, dualpipev (see above)
