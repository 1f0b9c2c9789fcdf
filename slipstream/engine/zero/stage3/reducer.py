"""ZeRO-3 gradients: each unit's reduce-scatter as its backward completes, into this rank's chunk.

Autograd accumulates each unit's gradients in its own tensors, copied into a send buffer at the
launch ([Note: gradients land in autograd's tensors]); the unit is reduce-scattered over
its group's reduce lane once per backward (in a fixed unit order on every rank, ``OrderedLauncher``)
and the result lands in (or is added to) the unit's gradient chunk, which persists until the step.
Every micro-step reduces: no rank ever holds a full gradient between micro-steps.

[Note: send buffers] A fresh send buffer costs page faults on every unit; send buffers come from
the pool the gathered units borrow from (``buffers.py``, [Note: gathered units borrow resident
buffers]), usually the very buffer the unit released a moment before. Buffers alive at once are
bounded by ``reduce_bucket_size``, and a reduction whose collective has finished is completed at
the next launch, so its buffer serves the next unit: before, with DeepSpeed's 5e8 default every
unit of a small model kept its buffer until the end of backward, the pool was empty when the next
unit asked, and each unit paid a fresh mmap'd buffer's page faults (~4 ms per 12.6 MB unit,
measured on gpt2-large at 2 ranks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from slipstream import comm
from slipstream.comm.context import CommContext, Pending
from slipstream.comm.quantized import reduce_scatter_across_nodes, reduce_scatter_quantized
from slipstream.engine.zero.grad_buckets import reduction_scales
from slipstream.engine.zero.offload.chunks import Chunks
from slipstream.engine.zero.ordered_launch import OrderedLauncher
from slipstream.engine.zero.stage3.buffers import UnitBuffers
from slipstream.engine.zero.stage3.unit import ParamUnit, TrainingState
from slipstream.engine.zero.strategy import ShardingOptions
from slipstream.engine.zero.used_flags import UsedFlags


@dataclasses.dataclass
class _Reduction:
    unit: ParamUnit
    work: Pending
    send: torch.Tensor  # in the model's dtype: returns to the pool
    receive: torch.Tensor
    into: str  # "chunk": landed in place; "copy" or "add": move ``receive`` into the gradient chunk


class UnitReducer:
    def __init__(
        self,
        units: list[ParamUnit],
        order: list[ParamUnit],
        options: ShardingOptions,
        dtype: torch.dtype,
        device: torch.device,
        used: UsedFlags,
        index: dict[int, int],
        new_chunk: Callable[[ParamUnit], torch.Tensor],
        buffers: UnitBuffers,
    ) -> None:
        """``order``: the fixed launch order; ``used``/``index``: flags of trainable parameters (by id) that got a gradient;
        ``buffers``: the pool send buffers come from ([Note: send buffers])."""
        self.options, self.dtype, self.device, self.used, self.index = options, dtype, device, used, index
        self.buffers = buffers
        self.communication_dtype = (
            options.communication_dtype if options.communication_dtype not in (None, dtype) else None
        )
        # Dividing by 2^k is exact before the sum or after; after, it scales the 1/world chunk at the boundary
        # instead of the whole unit at every reduce-scatter. Only where the sum cannot overflow (an fp32/fp64
        # wire) and the user did not ask for prescaling, which exists to avoid exactly that overflow.
        self.divide_after_sum = (
            dtype in (torch.float32, torch.float64)
            and self.communication_dtype is None
            and not options.prescale_gradients
        )
        # Chunks only for units with trainable parameters: a frozen backbone costs no gradient memory.
        self.chunks = {u.index: new_chunk(u) for u in units if u.trainable}
        self.offsets = {u.index: u.offset for u in units}
        self.launcher = OrderedLauncher([[u.index] for u in order], lambda i, waited: self._launch(order[i], waited))
        self.reductions: list[_Reduction] = []
        self.grads_before: dict[
            int, list[tuple[torch.Tensor, int] | None]
        ] = {}  # unit -> each .grad its backward started from
        self.has_grad: set[int] = set()  # units whose gradient chunk holds something this window
        self.context = CommContext()  # the strategy's (set by it): reduce-scatters on their own stream
        self.gradient_bits = 0  # qgZ: reduce-scatters travel as INT4 all-to-alls (set by the strategy)

    def grads(self) -> Chunks:
        """The gradient chunks in partition coordinates."""
        return Chunks([self.offsets[i] for i in self.chunks], list(self.chunks.values()))

    def remember_grads(self, unit: ParamUnit) -> None:
        """Note each ``.grad`` the unit's backward starts from, to tell later whether a gradient arrived.

        [Note: gradients land in autograd's tensors] Autograd computes every weight gradient into a
        fresh tensor whatever ``.grad`` holds; a ``.grad`` set beforehand only turns its hand-over
        into an in-place add. Pointing ``.grad`` at a zeroed send buffer therefore cost a memset of
        the unit and an add that reads it (measured on gpt2-large at 2 ranks: 1.8 ms a unit for the
        memset alone, ~1.5% of the step). Left unset, autograd hands its tensor over as it is, and
        the launch copies it into the send buffer once: one pass instead of three.
        """
        if unit.index not in self.chunks or unit.index in self.grads_before:
            return
        self.grads_before[unit.index] = [
            None if p.grad is None else (p.grad, p.grad._version) for p, _, _ in unit.ranges()
        ]

    def unit_done(self, unit: ParamUnit) -> None:
        """The unit's gradients for this backward are complete (once per pass; later calls are ignored)."""
        if unit.training_state is not TrainingState.POST_BACKWARD:
            unit.training_state = TrainingState.POST_BACKWARD
            self.launcher.mark_ready(unit.index, launch=self.options.overlap_comm)

    def _launch(self, unit: ParamUnit, waited: bool = False) -> None:
        if unit.index not in self.chunks:
            return  # frozen on every rank alike: nothing to reduce
        before = self.grads_before.pop(unit.index, None)
        send = self.buffers.take(
            unit.numel, self.dtype, self.device
        )  # every element is written below: gradients, zeros, padding
        ranges = unit.ranges()  # packed in order, padded after the last (flat_layout.py)
        grads = [p.grad for p, _, _ in ranges]
        end = ranges[-1][2] if ranges else 0
        # [Note: one copy packs the unit] Copying each gradient into its slice of the send buffer cost a slice and
        # a copy dispatched per parameter tensor, ~5 µs each: a tenth of a step of a model of a thousand small
        # tensors. The layout puts a unit's parameters end to end from its start (``FlatLayout._close``), so where
        # every gradient is there one ``torch.cat`` into the buffer's front writes them all.
        if grads and not [g for g in grads if g is None or g.dtype != send.dtype]:  # a list: no frame per tensor
            torch.cat([g.reshape(-1) for g in grads], out=send[:end])
        else:
            for (_, begin, stop), grad in zip(ranges, grads):
                if grad is not None:
                    send[begin:stop].copy_(grad.reshape(-1))
                else:
                    send[begin:stop].zero_()  # no gradient, frozen, or dropped by the user
        for k, ((p, _, _), grad) in enumerate(zip(ranges, grads)):
            start = before[k] if before is not None else None
            # arrived: anything but the gradient the backward started from, untouched
            arrived = grad is not None and (start is None or grad is not start[0] or grad._version != start[1])
            p.grad = None
            if arrived and id(p) in self.index:
                self.used.local[self.index[id(p)]] = 1  # a byte per tensor ([Note: flags on the host]), not a call
        send[end:].zero_()  # the padding (and a pooled buffer's old values)
        pre_scale, _ = self._scales(unit)
        if pre_scale != 1.0:
            send.mul_(pre_scale)
        chunk = self.chunks[unit.index]
        lanes, bits = unit.lanes, self.gradient_bits
        quantized = bits and (
            lanes.nodes is not None or lanes.crosses_nodes
        )  # qgZ: only what crosses nodes is quantized
        wire_dtype = (
            None if quantized else self.communication_dtype
        )  # qgZ's wire is its own: no cast of the send buffer
        wire = send if wire_dtype is None else send.to(wire_dtype)
        into = "add" if unit.index in self.has_grad else "copy"
        if into == "copy" and wire_dtype is None:
            receive, into = chunk, "chunk"
        else:
            receive = torch.empty(chunk.numel(), dtype=wire.dtype, device=chunk.device)
        self.has_grad.add(unit.index)
        tag = f"ZeRO-3 gradients of unit {unit.index} ({unit.spec.name})"
        if (
            quantized and lanes.nodes is not None
        ):  # summed inside each node, then INT4 across ([Note: quantize only what crosses nodes])
            node, across = lanes.nodes
            work = self.context.issue(
                "reduce_scatter",
                lambda: reduce_scatter_across_nodes(receive, send, node, across, tag=tag, bits=bits),
                tag,
            )
        elif quantized:  # a group whose nodes are not even blocks: INT4 over all of it
            work = self.context.issue(
                "reduce_scatter",
                lambda: reduce_scatter_quantized(receive, send, group=lanes.reduce, tag=tag, bits=bits),
                tag,
            )
        else:  # one node (or qgZ off): nothing crosses a slow link, nothing is quantized
            work = self.context.issue(
                "reduce_scatter",
                lambda: comm.reduce_scatter_tensor(receive, wire, group=lanes.reduce, tag=tag, inline=waited),
                tag,
            )
        self.reductions.append(_Reduction(unit, work, send, receive, into))
        # Bound the send buffers alive at once by reduce_bucket_size (at least the newest one), and take
        # back the ones whose reduce-scatter already finished (see [Note: send buffers]).
        while (
            len(self.reductions) > 1 and sum(r.send.numel() for r in self.reductions) > self.options.reduce_bucket_numel
        ):
            self._complete(self.reductions.pop(0))
        while self.reductions and self.reductions[0].work.ready():
            self._complete(self.reductions.pop(0))

    def _scales(self, unit: ParamUnit) -> tuple[float, float]:
        o = self.options
        world = unit.lanes.average_world
        pre, post = reduction_scales(world, o.gradient_predivide_factor, o.prescale_gradients, o.average)
        if self.divide_after_sum and post == 1.0 and pre == 1.0 / world and world & (world - 1) == 0:
            return 1.0, pre
        return pre, post

    def _complete(self, reduction: _Reduction) -> None:
        reduction.work.wait()
        chunk = self.chunks[reduction.unit.index]
        if reduction.into == "add":
            chunk.add_(reduction.receive)
        elif reduction.into == "copy":
            chunk.copy_(reduction.receive)
        self.context.recycle(
            reduction.work, lambda: self.buffers.give(reduction.send)
        )  # only after the collective read it

    def end_backward(self, units: list[ParamUnit]) -> None:
        """Every unit of the pass reduced exactly once on every rank (in order), all reductions complete."""
        for unit in units:
            self.unit_done(unit)
        self.launcher.flush()
        while self.reductions:
            self._complete(self.reductions.pop(0))
        self.launcher.reset()
        for unit in units:
            unit.training_state = TrainingState.IDLE

    def finish(self, units: list[ParamUnit]) -> None:
        """The boundary: MiCS's sum across replicas, then the rest of the averaging (``gradient_predivide_factor``).

        [Note: MiCS sums across replicas once a step] A MiCS shard group reduce-scatters each
        micro-step's gradients inside itself, as ZeRO-3 does over the whole group; the replicas
        (same partition, other shard groups, other data) add theirs only here, once per optimizer
        step, however many micro-steps accumulated. Every chunk is then the sum over all ranks,
        scaled by the whole data-parallel size (``GroupLanes.average_world``), the same value on
        every replica, so their optimizers take the same step.
        """
        pending = [
            comm.all_reduce(
                self.chunks[u.index], group=u.lanes.replicas, tag=f"MiCS gradients of unit {u.index} across replicas"
            )
            for u in units
            if u.lanes.replicas is not None and u.index in self.chunks
        ]
        for work in pending:
            work.wait()
        for unit in units:
            _, post_scale = self._scales(unit)
            if post_scale != 1.0 and unit.index in self.chunks:
                self.chunks[unit.index].mul_(post_scale)

    def zero(self) -> None:
        for chunk in self.chunks.values():
            chunk.zero_()
        self.has_grad.clear()

    def grad_bytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.chunks.values())
