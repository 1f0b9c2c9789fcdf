"""The pipeline's instruction set: what one rank does, in order, during one training step.

A schedule is data: for every rank a list of :class:`Action`\\ s (compute: forward, backward,
backward-input, backward-weight; communication: send/receive of activations and gradients). The
generators in ``schedules.py`` write the compute actions, :func:`with_communication` adds the
transfers, the simulator (``simulate.py``) costs and checks them, and the executor
(``executor.py``) runs them. The text form is torch.distributed.pipelining's (``"1F0"``: stage 1,
forward, micro-batch 0), so schedules can be compared with its generators.
"""

from __future__ import annotations

import dataclasses
import enum
import re


class Op(str, enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"  # input and weight gradients in one pass
    BACKWARD_INPUT = "I"  # zero-bubble schedules: the input gradient first (the next stage waits for it) ...
    BACKWARD_WEIGHT = "W"  # ... the weight gradient later, to fill a bubble
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"


COMPUTE = (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)
_PATTERN = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")


@dataclasses.dataclass(frozen=True, order=True)
class Action:
    stage: int
    op: Op
    micro: int

    def __str__(self) -> str:
        return f"{self.stage}{self.op.value}{self.micro}"

    @staticmethod
    def parse(text: str) -> Action:
        match = _PATTERN.match(text)
        if match is None:
            raise ValueError(f"not a pipeline action: {text!r} (expected e.g. '1F0', '0SEND_B3')")
        return Action(int(match.group(1)), Op(match.group(2)), int(match.group(3)))


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """Which rank runs which stage: ``loop`` (stage k on rank k mod p) or ``v`` (rank r: stages r and 2p-1-r)."""

    ranks: int
    stages_per_rank: int
    style: str = "loop"

    @property
    def num_stages(self) -> int:
        return self.ranks * self.stages_per_rank

    def rank_of(self, stage: int) -> int:
        if self.style == "v":
            return stage if stage < self.ranks else 2 * self.ranks - 1 - stage
        return stage % self.ranks

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s in range(self.num_stages) if self.rank_of(s) == rank)


def with_communication(
    compute: list[list[Action]], layout: StageLayout, pairs: tuple[frozenset[int], ...] | None = None
) -> list[list[Action]]:
    """Each rank's compute actions with the transfers they need, in an order that cannot deadlock.

    A send follows the action that produced its tensor; a receive comes right before the action
    that needs it. Stages on the same rank (the V layouts) hand tensors over without a transfer.
    Sends are asynchronous, so a rank blocks only on receives; as long as the compute order is
    dependency-valid (``simulate.check``) every receive is eventually matched. An overlapped pair
    (``pairs[rank]`` holds the index of its forward) receives what both halves need before either
    starts and sends after both: its halves take turns on one rank and must not block inside.
    (A DualPipeV pair receives both halves' tensors from one neighbour and sends both to the other, so
    receiving early waits for nothing the pair's own sends would unblock.)
    """
    last = layout.num_stages - 1

    def receives(a: Action, rank: int) -> list[Action]:
        if a.op is Op.FORWARD and a.stage > 0 and layout.rank_of(a.stage - 1) != rank:
            return [Action(a.stage, Op.RECV_F, a.micro)]
        if a.op in (Op.BACKWARD, Op.BACKWARD_INPUT) and a.stage < last and layout.rank_of(a.stage + 1) != rank:
            return [Action(a.stage, Op.RECV_B, a.micro)]
        return []

    def sends(a: Action, rank: int) -> list[Action]:
        if a.op is Op.FORWARD and a.stage < last and layout.rank_of(a.stage + 1) != rank:
            return [Action(a.stage, Op.SEND_F, a.micro)]
        if a.op in (Op.BACKWARD, Op.BACKWARD_INPUT) and a.stage > 0 and layout.rank_of(a.stage - 1) != rank:
            return [Action(a.stage, Op.SEND_B, a.micro)]
        return []

    out: list[list[Action]] = []
    for rank, actions in enumerate(compute):
        paired = pairs[rank] if pairs else frozenset()
        plan: list[Action] = []
        i = 0
        while i < len(actions):
            group = actions[i : i + 2] if i in paired else actions[i : i + 1]
            for a in group:
                plan += receives(a, rank)
            plan += group
            for a in group:
                plan += sends(a, rank)
            i += len(group)
        out.append(plan)
    return out
