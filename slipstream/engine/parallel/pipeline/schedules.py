"""Schedule generators: for p ranks and m micro-batches, each rank's compute actions in order.

Every generator returns one list of :class:`Action` per rank (compute only; transfers are added by
``actions.with_communication``). The orders are the published ones, and the tests check them
action for action against torch.distributed.pipelining's generators where torch has the schedule:

* ``afab`` (GPipe): all forwards, then all backwards. Peak in flight: m per stage.
* ``1f1b``: p-1-r warm-up forwards, then one forward and one backward alternately.
* ``interleaved_1f1b`` (Megatron): v stages per rank in a loop layout; micro-batches go through
  the local stages in rounds of ``m // max(1, m // p)``; bubble (p-1)/(v·m).
* ``zb1p`` (zero bubble, "ZB-H1"): 1F1B with the backward split into input (I) and weight (W)
  gradients; rank r holds back its W's by r, and they fill the cool-down bubble.
* ``zbv`` (zero bubble, V layout, v = 2): rank r holds stages r and 2p-1-r.
* ``dualpipev`` (DeepSeek's DualPipe folded into a V): forward of one chunk paired with the
  backward of the other in the steady state ("F&B"); needs m ≥ 2p.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

from slipstream.engine.config import ConfigError
from slipstream.engine.parallel.pipeline.actions import Action, Op, StageLayout

NAMES = ("afab", "1f1b", "interleaved_1f1b", "zb1p", "zbv", "dualpipev")
ALIASES = {"gpipe": "afab"}
F, B, I, W = Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT  # noqa: E741 (the schedule letters)


@dataclasses.dataclass(frozen=True)
class Schedule:
    name: str
    micro_batches: int
    layout: StageLayout
    compute: tuple[tuple[Action, ...], ...]  # per rank
    # Per rank, the indices i where compute[i] (a forward) and compute[i + 1] (another micro-batch's
    # backward) run as one overlapped pair, DualPipe's "F&B" (executor.py, comm/overlap.py).
    pairs: tuple[frozenset[int], ...] = ()

    def __post_init__(self) -> None:
        for rank, indices in enumerate(self.pairs):
            for i in indices:
                f, b = self.compute[rank][i], self.compute[rank][i + 1]
                if f.op is not F or b.op not in (B, I) or (f.stage, f.micro) == (b.stage, b.micro):
                    raise ValueError(
                        f"pipeline: {f} and {b} on rank {rank} cannot overlap (a forward and another micro-batch's backward can)"
                    )

    @property
    def split_backward(self) -> bool:
        return any(a.op is I for actions in self.compute for a in actions)

    def paired(self, rank: int) -> frozenset[int]:
        """Rank ``rank``'s indices of paired forwards (none for a schedule without pairs)."""
        return self.pairs[rank] if self.pairs else frozenset()

    def partners(self, rank: int) -> dict[Action, Action]:
        """Rank ``rank``'s paired forwards, each with the backward that overlaps it."""
        actions = self.compute[rank]
        return {actions[i]: actions[i + 1] for i in self.paired(rank)}

    def text(self, rank: int) -> str:
        """Rank ``rank``'s compute actions in torch's text form, a pair as ``(F;B)`` (DualPipe's "F&B")."""
        actions, pairs = self.compute[rank], self.paired(rank)
        words, i = [], 0
        while i < len(actions):
            if i in pairs:
                words.append(f"({actions[i]};{actions[i + 1]})")
                i += 2
            else:
                words.append(str(actions[i]))
                i += 1
        return " ".join(words)


def layout_for(name: str, ranks: int, virtual_stages: int) -> StageLayout:
    name = ALIASES.get(name, name)
    if name in ("zbv", "dualpipev"):
        return StageLayout(ranks, 2, "v")
    if name in ("interleaved_1f1b", "zb1p"):
        return StageLayout(ranks, virtual_stages, "loop")
    return StageLayout(ranks, 1, "loop")


def check(name: str, ranks: int, micro_batches: int, virtual_stages: int) -> None:
    """Raise ``ValueError("<key>: ...")`` for a combination the schedule cannot run."""
    name = ALIASES.get(name, name)
    p, m, v = ranks, micro_batches, virtual_stages
    if name not in NAMES:
        raise ConfigError(f"pipeline.schedule: {name!r} is not a schedule; use one of {', '.join(NAMES)}")
    if name in ("1f1b", "interleaved_1f1b", "zb1p") and m < p:
        raise ConfigError(
            f"gradient_accumulation_steps: {m} micro-batches cannot fill a {name} pipeline of {p} stages "
            f"(pipeline.stages); use at least {p}"
        )
    if name == "dualpipev" and m < 2 * p:
        raise ConfigError(
            f"gradient_accumulation_steps: dualpipev needs at least 2 × pipeline.stages = {2 * p} micro-batches, got {m}"
        )
    if name in ("zbv", "dualpipev") and v != 2 and v != 1:
        raise ConfigError(f"pipeline.virtual_stages: {name} runs exactly 2 stages per rank (a V), got {v}")
    if name in ("afab", "1f1b") and v != 1:
        raise ConfigError(
            f"pipeline.virtual_stages: {v} needs an interleaved schedule (interleaved_1f1b, zb1p, zbv, dualpipev), not {name}"
        )
    if name in ("interleaved_1f1b", "zb1p") and m % max(1, m // p):
        raise ConfigError(
            f"gradient_accumulation_steps: {name} runs micro-batches in rounds of about pipeline.stages = {p}; {m} is "
            f"not a multiple of its {max(1, m // p)} rounds"
        )


def build(name: str, ranks: int, micro_batches: int, virtual_stages: int = 1) -> Schedule:
    name = ALIASES.get(name, name)
    check(name, ranks, micro_batches, virtual_stages)
    layout = layout_for(name, ranks, virtual_stages)
    generate: Callable[[int], list[Action]] | None = {
        "afab": lambda r: _afab(r, micro_batches),
        "1f1b": lambda r: _merge(_order(r, ranks, micro_batches, 1), ranks - 1 - r, split=False, lag=0),
        "interleaved_1f1b": lambda r: _interleaved(r, ranks, micro_batches, virtual_stages, zero_bubble=False),
        "zb1p": lambda r: _interleaved(r, ranks, micro_batches, virtual_stages, zero_bubble=True),
        "zbv": lambda r: _zbv(r, ranks, micro_batches),
    }.get(name)
    if generate is None:  # dualpipev: actions and the pairs that overlap
        built = [_dualpipev(r, ranks, micro_batches) for r in range(ranks)]
        return Schedule(
            name, micro_batches, layout, tuple(tuple(a) for a, _ in built), tuple(pairs for _, pairs in built)
        )
    return Schedule(name, micro_batches, layout, tuple(tuple(generate(r)) for r in range(ranks)))


# ----------------------------------------------------------------------------- loop layouts
def _afab(rank: int, m: int) -> list[Action]:
    return [Action(rank, F, i) for i in range(m)] + [Action(rank, B, i) for i in range(m)]


def _order(rank: int, p: int, m: int, v: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The (stage, micro) order of this rank's forwards and of its backwards.

    Micro-batches pass the local stages in rounds: a round's micro-batches all go through local
    stage 0, then all through local stage 1, ...; backwards visit the local stages in reverse.
    """
    per_round = m // max(1, m // p)
    total = v * m
    seen: dict[int, int] = collections.defaultdict(int)
    forwards = []
    for step in range(total):
        stage = ((step // per_round) % v) * p + rank
        forwards.append((stage, seen[stage]))
        seen[stage] += 1
    seen.clear()
    backwards = []
    for k in range(total):
        stage = (v - 1 - (k // per_round) % v) * p + rank
        backwards.append((stage, seen[stage]))
        seen[stage] += 1
    return forwards, backwards


def _merge(
    order: tuple[list[tuple[int, int]], list[tuple[int, int]]], warmup: int, split: bool, lag: int
) -> list[Action]:
    """Warm-up forwards, then one forward and one backward alternately, then the remaining backwards.

    ``split``: backwards are input-gradient passes, and the weight pass of the k-th one runs after
    the (k + lag)-th, so the first ``lag`` weight passes slide into the cool-down.
    """
    forwards, backwards = order
    warmup = min(warmup, len(forwards))
    out = [Action(s, F, i) for s, i in forwards[:warmup]]
    deferred: collections.deque[tuple[int, int]] = collections.deque()
    for k, (s, i) in enumerate(backwards):
        if warmup + k < len(forwards):
            fs, fi = forwards[warmup + k]
            out.append(Action(fs, F, fi))
        out.append(Action(s, I if split else B, i))
        if split:
            deferred.append((s, i))
            if k >= lag:
                ws, wi = deferred.popleft()
                out.append(Action(ws, W, wi))
    out.extend(Action(s, W, i) for s, i in deferred)
    return out


def _interleaved(rank: int, p: int, m: int, v: int, zero_bubble: bool) -> list[Action]:
    per_round = m // max(1, m // p)
    # Warm-up: enough forwards that the first backward of the last local stage can start at once;
    # each hop from the last rank adds one forward (zero bubble) or two (1F1B: a forward and the
    # backward it waits for).
    warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (p - 1 - rank), v * m)
    return _merge(_order(rank, p, m, v), warmup, split=zero_bubble, lag=rank if zero_bubble else 0)


# ----------------------------------------------------------------------------- V layouts
class _Counters:
    """Next micro-batch per (stage, pass) and the weight passes waiting, for the V schedules."""

    def __init__(self) -> None:
        self.next: dict[tuple[int, str], int] = collections.defaultdict(int)
        self.weights: collections.deque[tuple[int, int]] = collections.deque()
        self.out: list[Action] = []

    def forward(self, stage: int) -> None:
        self.out.append(Action(stage, F, self.next[stage, "F"]))
        self.next[stage, "F"] += 1

    def backward(self, stage: int, split: bool) -> None:
        micro = self.next[stage, "B"]
        self.next[stage, "B"] += 1
        self.out.append(Action(stage, I if split else B, micro))
        if split:
            self.weights.append((stage, micro))

    def weight(self) -> None:
        if self.weights:
            stage, micro = self.weights.popleft()
            self.out.append(Action(stage, W, micro))


def _zbv(rank: int, p: int, m: int) -> list[Action]:
    """ZB-V: chunk 0 (stage r) fills the pipe, chunk 1 (stage 2p-1-r) turns the micro-batch back."""
    n = max(2 * p - 1, m)  # enough micro-batches to fill the V; the surplus is dropped at the end
    down, up = rank, 2 * p - 1 - rank
    c = _Counters()
    for _ in range(2 * (p - rank) - 1):
        c.forward(down)
    for _ in range(rank):
        c.forward(up)
        c.forward(down)
    for _ in range(p - rank):
        c.forward(up)
        c.backward(up, split=True)
        c.weight()
    while c.next[up, "F"] < c.next[down, "F"] or c.next[down, "F"] < n:
        if c.next[down, "F"] < n:
            c.forward(down)
        c.backward(down, split=True)
        c.weight()
        c.forward(up)
        c.backward(up, split=True)
        c.weight()
    # Cool-down: input gradients first (they unblock the ranks above), weights after.
    for _ in range(rank):
        c.backward(down, split=True)
        c.backward(up, split=True)
    downs = collections.deque(w for w in c.weights if w[0] == down)
    ups = collections.deque(w for w in c.weights if w[0] == up)
    tail: list[Action] = []
    for _ in range(p - rank):
        micro = c.next[down, "B"]
        c.next[down, "B"] += 1
        tail.append(Action(down, I, micro))
        downs.append((down, micro))
        s, i = downs.popleft()
        tail.append(Action(s, W, i))
    tail += [Action(s, W, i) for s, i in ups] + [Action(s, W, i) for s, i in downs]
    return [a for a in c.out + tail if a.micro < m]


def _dualpipev(rank: int, p: int, m: int) -> tuple[list[Action], frozenset[int]]:
    """DualPipeV: after the warm-up each step pairs one chunk's forward with the other's backward."""
    down, up = rank, 2 * p - 1 - rank
    c = _Counters()
    pairs: set[int] = set()

    def paired(forward_stage: int, backward_stage: int) -> None:  # "F&B": one's all-to-alls overlap the other's compute
        pairs.add(len(c.out))
        c.forward(forward_stage)
        c.backward(backward_stage, split=False)

    for _ in range(2 * (p - rank - 1)):
        c.forward(down)
    for _ in range(rank + 1):
        c.forward(down)
        c.forward(up)
    for _ in range(p - rank - 1):
        c.backward(up, split=True)
        c.weight()
        c.forward(up)
    for i in range(m - 2 * p + rank + 1):
        if i == 0 and rank == p - 1:  # the turn of the V: nothing to overlap yet
            c.forward(down)
            c.backward(up, split=False)
        else:
            paired(down, up)
        paired(up, down)
    for _ in range(p - rank - 1):
        c.backward(up, split=False)
        paired(up, down)
    split = False
    for i in range(rank + 1):  # the second half of the cool-down defers weight passes into the bubble
        if i == (rank + 1) // 2 and rank % 2 == 1:
            split = True
        c.backward(up, split=split)
        if i == (rank + 1) // 2 and rank % 2 == 0:
            split = True
        c.backward(down, split=split)
    for _ in range(p - rank - 1):
        c.weight()
        c.backward(down, split=split)
    for _ in range(rank + 1):
        c.weight()
    return c.out, frozenset(pairs)
