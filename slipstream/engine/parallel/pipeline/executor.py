"""Run one rank's action list: forwards, (split) backwards and the transfers between stages.

The executor owns the step's buffers: activations received (``inputs``), stage outputs kept for
their backward (``outputs``), gradients received (``grads``) and deferred weight passes. Each is
dropped as soon as the action that needs it last has run, so what a rank holds at any time is
what the schedule says (``simulate.peak_in_flight``). Sends are asynchronous and waited on at the
end of the step; receives block, which cannot deadlock for a schedule ``simulate`` accepted.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from slipstream import comm
from slipstream.comm import overlap, p2p
from slipstream.comm.collectives import Work
from slipstream.comm.context import CommContext, Pending
from slipstream.engine.parallel.calls import accepts_use_cache, call_model, loss_of, router_loss_of, without_cache
from slipstream.engine.parallel.pipeline.actions import Action, Op, with_communication
from slipstream.engine.parallel.pipeline.cut import StageGate, StageOutput
from slipstream.engine.parallel.pipeline.schedules import Schedule
from slipstream.engine.parallel.pipeline.simulate import Costs, simulate
from slipstream.engine.parallel.pipeline.split_backward import WeightPass, backward_input
from slipstream.errors import UsageError


@dataclasses.dataclass(frozen=True)
class StepTiming:
    """One rank's step: wall time of the schedule, time in compute, and per-pass mean costs."""

    wall: float
    compute: float
    costs: dict[int, Costs]  # each stage's mean pass costs (every stage of the pipeline, gathered)
    in_flight: dict[int, int] = dataclasses.field(
        default_factory=dict
    )  # per local stage: most outputs held for their backward
    executed: tuple[Action, ...] = ()  # this rank's compute actions in the order they ran (replayable by simulate)
    overlapped: int = 0  # collectives (expert all-to-alls) in flight while the other half of a DualPipeV pair computed

    @property
    def bubble(self) -> float:
        return (self.wall - self.compute) / self.compute if self.compute > 0 else 0.0


class Executor:
    def __init__(
        self,
        model: torch.nn.Module,
        gate: StageGate,
        schedule: Schedule,
        pp_rank: int,
        peers: tuple[int, ...],
        group: dist.ProcessGroup | None,
        weights: Callable[[], list[torch.nn.Parameter]],
        synchronized_timing: bool = False,
    ) -> None:
        """``peers``: global rank of each pipeline rank; ``weights``: this rank's trainable parameters;
        ``synchronized_timing`` (``wall_clock_breakdown``): see [Note: timing a step]."""
        self.model, self.gate, self.schedule = model, gate, schedule
        # Tensors a stage hands the next: its hidden state, and with a carry the router logits (carry.py).
        self.parts = (2 if gate.carry is not None and gate.carry.sends else 1) + len(gate.extras)
        self.layout = schedule.layout
        self.rank, self.peers, self.group, self.weights = pp_rank, peers, group, weights
        self.synchronized_timing = synchronized_timing
        # The last stage's model output → what its loss is read from, given the micro-batch index (the
        # sequence sharder's combine under Ulysses / ring attention: runners/pipeline.py). None: as it is.
        self.finish: Callable[[Any, int], Any] | None = None
        self.actions = with_communication([list(a) for a in schedule.compute], self.layout, schedule.pairs)[pp_rank]
        self.partners = schedule.partners(pp_rank)  # forward -> the backward it overlaps ("F&B")
        self.second_halves = frozenset(self.partners.values())
        self.last = self.layout.num_stages - 1
        self.cacheless = accepts_use_cache(model)  # [Note: no cache in a pipeline stage]
        self.context = CommContext()  # transfers on their own stream, ordered by events (comm/context.py)
        self.router_losses: dict[
            int, torch.Tensor
        ] = {}  # last stage: each micro-batch's balancing loss (aux_loss), if any

    # ------------------------------------------------------------------ training step
    def train(self, batches: list[Any], scale: float) -> tuple[list[torch.Tensor], StepTiming]:
        """Run the schedule over ``batches`` (one per micro-batch); backward seeds are ``loss · scale``.

        Returns the last stage's unscaled losses (empty on other ranks) and the step's timing.
        """
        # A stage's input, output and their gradients are lists: the hidden state, then what a carry hands on.
        inputs: dict[tuple[int, int], list[torch.Tensor]] = {}
        outputs: dict[tuple[int, int], list[torch.Tensor]] = {}
        grads: dict[tuple[int, int], list[torch.Tensor]] = {}
        sent_back: dict[tuple[int, int], list[torch.Tensor]] = {}
        deferred: dict[tuple[int, int], WeightPass | tuple[list[torch.Tensor], list[torch.Tensor] | None]] = {}
        losses: dict[int, torch.Tensor] = {}
        sends: list[Pending] = []
        spent: dict[tuple[int, Op], list[float]] = {}
        in_flight: dict[int, int] = {}
        executed: list[Action] = []
        overlapped = 0
        # [Note: timing a step] Under wall_clock_breakdown the ranks start from one barrier, so each
        # rank's idle time includes its wait for the first activation (the warm-up bubble), and the
        # step lasts until the last rank is done (a MAX all-reduce: the last stage of 1F1B finishes
        # early and idles until the step ends, as in the simulator's makespan). Without it the step
        # pays for neither collective and each rank reports its own wall time (a lower bound).
        if self.synchronized_timing:
            comm.barrier(self.group, tag="pipeline step start")
        start = time.perf_counter()
        for a in self.actions:
            key = (a.stage, a.micro)
            if a.op is Op.RECV_F:
                inputs[key] = [t.requires_grad_() for t in self._receive_activation(a)]
            elif a.op is Op.RECV_B:
                grads[key] = self._receive_gradient(a, outputs[key])
            elif a.op is Op.SEND_F:
                sends += self._send_activation(a, [t.detach().contiguous() for t in outputs[key]])
            elif a.op is Op.SEND_B:
                for part, grad in enumerate(sent_back.pop(key)):
                    sends.append(self._send_gradient(a, part, grad.contiguous()))
            elif a in self.second_halves:
                continue  # the second half of a pair: ran with its forward
            else:
                state = (batches, inputs, outputs, grads, sent_back, deferred, losses, scale)
                partner = self.partners.get(a)
                if partner is None:
                    began = time.perf_counter()
                    self._compute(a, *state)
                    ran = [(a, time.perf_counter() - began)]
                else:  # [Note: taking turns] in comm/overlap.py
                    pair = overlap.Pair()
                    pair.run(lambda: self._compute(a, *state), lambda: self._compute(partner, *state))
                    overlapped += pair.overlapped
                    ran = [(a, pair.held[0]), (partner, pair.held[1])]
                for action, seconds in ran:
                    spent.setdefault((action.stage, action.op), []).append(seconds)
                    executed.append(action)
                    if action.op is Op.FORWARD:
                        held = sum(1 for s, _ in outputs if s == action.stage)
                        in_flight[action.stage] = max(in_flight.get(action.stage, 0), held)
        for work in sends:
            work.wait()
        wall = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        if self.synchronized_timing:
            comm.all_reduce(wall, op=dist.ReduceOp.MAX, group=self.group, tag="pipeline step time").wait()
        compute = sum(sum(v) for v in spent.values())
        timing = StepTiming(float(wall), compute, self._stage_costs(spent), in_flight, tuple(executed), overlapped)
        return [losses[i] for i in sorted(losses)], timing

    def _compute(
        self,
        a: Action,
        batches: list[Any],
        inputs: dict,
        outputs: dict,
        grads: dict,
        sent_back: dict,
        deferred: dict,
        losses: dict,
        scale: float,
    ) -> None:
        key = (a.stage, a.micro)
        if a.op is Op.FORWARD:
            out = self.forward(a.stage, batches[a.micro], inputs.get(key), a.micro)
            if a.stage == self.last:
                losses[a.micro] = out.detach()
                outputs[key] = [out.float() * scale]
                return
            if self.layout.rank_of(a.stage + 1) == self.rank:  # the next stage is here: no transfer
                inputs[(a.stage + 1, a.micro)] = [t.detach().requires_grad_() for t in out]
            outputs[key] = out
            return
        if a.op is Op.BACKWARD_WEIGHT:
            work = deferred.pop(key)
            if isinstance(work, WeightPass):
                work.run()
            else:
                _backward(*work)
            return
        outs, seeds = outputs.pop(key), grads.pop(key, None)
        received = inputs.pop(key, None)
        if a.op is Op.BACKWARD:
            _backward(outs, seeds)
            input_grads = [t.grad for t in received] if received is not None else None
        elif received is None:  # stage 0 has no input to differentiate: its whole backward is the weight pass
            deferred[key] = (outs, seeds)
            return
        else:
            input_grads, deferred[key] = backward_input(outs, seeds, received, self.weights())
        if a.stage == 0:
            return
        assert received is not None and input_grads is not None
        input_grads = [g if g is not None else torch.zeros_like(t) for g, t in zip(input_grads, received, strict=True)]
        if self.layout.rank_of(a.stage - 1) == self.rank:
            grads[(a.stage - 1, a.micro)] = input_grads
        else:
            sent_back[key] = input_grads

    # ------------------------------------------------------------------ forward only
    def evaluate(self, batches: list[Any]) -> list[torch.Tensor]:
        """Every micro-batch forward through this rank's stages in order, without gradients."""
        losses: list[torch.Tensor] = []
        sends: list[Pending] = []
        with torch.no_grad():
            for i, batch in enumerate(batches):
                handed: list[torch.Tensor] | None = None
                for stage in self.layout.stages_of(self.rank):
                    received = handed
                    if stage > 0 and self.layout.rank_of(stage - 1) != self.rank:
                        received = self._receive_activation(Action(stage, Op.RECV_F, i))
                    out = self.forward(stage, batch, received, i)
                    if stage == self.last:
                        losses.append(out.detach())
                    elif self.layout.rank_of(stage + 1) != self.rank:
                        sends += self._send_activation(Action(stage, Op.SEND_F, i), [t.contiguous() for t in out])
                    else:
                        handed = out
        for work in sends:
            work.wait()
        return losses

    # ------------------------------------------------------------------ pieces
    def forward(self, stage: int, batch: Any, received: list[torch.Tensor] | None, micro: int = 0) -> Any:
        """The model's forward made stage ``stage``'s: what it hands on (the hidden state, then what the carry takes),
        or its loss on the last stage (of micro-batch ``micro``, through ``finish`` when set). ``received``: the
        previous stage's hand-over in the same form."""
        self.gate.active, self.gate.received = stage, received
        try:
            output = call_model(self.model, without_cache(batch) if self.cacheless else batch)
        except StageOutput as done:
            return self._parts(done.outputs)
        finally:
            self.gate.active, self.gate.received = None, None
        if stage != self.last:
            raise UsageError(
                f"pipeline: stage {stage}'s forward ran to the end of the model without reaching its last block"
            )
        finished = self.finish(output, micro) if self.finish is not None else output
        router = router_loss_of(finished)
        if router is not None:
            self.router_losses[micro] = router.detach()
        return loss_of(finished)

    def _stage_costs(self, spent: dict[tuple[int, Op], list[float]]) -> dict[int, Costs]:
        """Every stage's mean forward / input-gradient / weight-gradient time, shared over the pipeline (one all-reduce)."""
        table = torch.zeros(self.layout.num_stages, 3, dtype=torch.float64)
        for stage in self.layout.stages_of(self.rank):
            mean = {op: sum(t) / len(t) for (s, op), t in spent.items() if s == stage and t}
            if Op.BACKWARD_INPUT in mean:
                table[stage] = torch.tensor(
                    [mean.get(Op.FORWARD, 0.0), mean[Op.BACKWARD_INPUT], mean.get(Op.BACKWARD_WEIGHT, 0.0)]
                )
            else:  # a full backward: counted as halves (the simulator adds them back for a B)
                full = mean.get(Op.BACKWARD, 0.0)
                table[stage] = torch.tensor([mean.get(Op.FORWARD, 0.0), full / 2, full / 2])
        comm.all_reduce(table, group=self.group, tag="pipeline stage costs").wait()
        return {s: Costs(*map(float, table[s])) for s in range(self.layout.num_stages)}

    def _p2p(self, transfer: Callable[[], Work]) -> Pending:
        """A send or receive on the context's P2P stream (ordered after the compute that wrote its tensor)."""
        return self.context.issue("p2p", transfer, "pipeline transfer")

    def _peer(self, stage: int) -> int:
        return self.peers[self.layout.rank_of(stage)]

    def _parts(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        if len(parts) != self.parts:
            raise UsageError(
                f"pipeline: a stage handed on {len(parts)} tensors where the pipeline carries {self.parts}"
            )
        return parts

    def _receive_activation(self, a: Action) -> list[torch.Tensor]:
        source, received = self._peer(a.stage - 1), []
        for part in range(self.parts):
            what = "activation" if part == 0 else "carried activation"
            head = torch.empty(p2p.HEADER, dtype=torch.int64)
            self._p2p(
                lambda: p2p.recv(
                    head,
                    source,
                    p2p.channel(a.stage, 0, a.micro, part),
                    self.group,
                    tag=f"pipeline shape {a}",
                    op="p2p_meta",
                )
            ).wait()
            buf = p2p.empty_from(head, _device_of(self.model))
            self._p2p(
                lambda: p2p.recv(
                    buf, source, p2p.channel(a.stage, 1, a.micro, part), self.group, tag=f"pipeline {what} {a}"
                )
            ).wait()
            received.append(buf)
        return received

    def _send_activation(self, a: Action, tensors: list[torch.Tensor]) -> list[Pending]:
        to, pending = self._peer(a.stage + 1), []
        for part, tensor in enumerate(tensors):
            what, head = "activation" if part == 0 else "carried activation", p2p.header(tensor)
            pending.append(
                self._p2p(
                    lambda: p2p.send(
                        head,
                        to,
                        p2p.channel(a.stage + 1, 0, a.micro, part),
                        self.group,
                        tag=f"pipeline shape {a}",
                        op="p2p_meta",
                    )
                )
            )
            pending.append(
                self._p2p(
                    lambda: p2p.send(
                        tensor, to, p2p.channel(a.stage + 1, 1, a.micro, part), self.group, tag=f"pipeline {what} {a}"
                    )
                )
            )
        return pending

    def _receive_gradient(self, a: Action, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        grads = []
        for part, out in enumerate(outputs):
            # Contiguous whatever the output's strides (a Megatron sequence-parallel stage hands on a
            # transposed view): the sender sends a contiguous gradient and gloo receives into one.
            buf = torch.empty_like(out, memory_format=torch.contiguous_format)
            self._p2p(
                lambda: p2p.recv(
                    buf,
                    self._peer(a.stage + 1),
                    p2p.channel(a.stage, 2, a.micro, part),
                    self.group,
                    tag=f"pipeline gradient {a}",
                )
            ).wait()
            grads.append(buf)
        return grads

    def _send_gradient(self, a: Action, part: int, grad: torch.Tensor) -> Pending:
        return self._p2p(
            lambda: p2p.send(
                grad,
                self._peer(a.stage - 1),
                p2p.channel(a.stage - 1, 2, a.micro, part),
                self.group,
                tag=f"pipeline gradient {a}",
            )
        )


def _backward(outputs: list[torch.Tensor], seeds: list[torch.Tensor] | None) -> None:
    """Backward from a stage's outputs (seeded with the gradients received for them; a scalar loss needs none),
    skipping an output nothing differentiable produced (an empty carry)."""
    pairs = [(out, seeds[i] if seeds is not None else None) for i, out in enumerate(outputs) if out.requires_grad]
    if pairs:
        torch.autograd.backward([out for out, _ in pairs], [seed for _, seed in pairs] if seeds is not None else None)


def _device_of(model: torch.nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def predicted_bubble(schedule: Schedule, costs: dict[int, Costs], rank: int) -> float:
    """Rank ``rank``'s bubble in the schedule with these stage costs and free transfers (the monitor's prediction)."""
    return simulate(schedule, costs).bubble(rank)
