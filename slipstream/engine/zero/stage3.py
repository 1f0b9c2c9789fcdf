"""ZeRO stage 3: parameters, gradients and optimizer state all partitioned; units gathered by hooks.

Each rank keeps only its chunk of every unit (``param_shard``), the matching gradient chunk and
the optimizer state for it. A unit's full parameters exist while its forward or backward runs:

* forward: the model's pre-hook starts a *pass*; a unit's pre-hook gathers it (one all-gather,
  plus prefetch of the next units in registration order) and its post-hook frees it;
* backward: a hook on the unit's outputs gathers it again before its backward; an autograd
  function wrapped around its inputs fires when its backward is done, and the unit's gradients
  are packed, reduce-scattered into this rank's gradient chunk and the unit freed.

[Note: the gather cursor] Collectives must be issued in the same order on every rank, but ranks
may run different units (data-dependent control flow). Each pass therefore walks a fixed order
(registration order forward, the reverse backward) with a cursor: needing unit k gathers every
unit from the cursor up to k, whether this rank runs them or not; units passed over are freed
(and, in backward, reduce-scatter zeros). At the end of each pass the cursor runs to the end, so
every rank gathers every unit once per pass and reduce-scatters every unit once per backward.
All-gathers and reduce-scatters travel on separate process groups (``comm.lane_group``), so each
kind only has to match its own order. A unit needed again after the cursor passed it (a module
called twice) is gathered once more; ranks must agree on such repeats.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from slipstream import comm
from slipstream.accelerator import get_accelerator
from slipstream.checkpointing import is_recomputing
from slipstream.engine.zero.grad_buckets import reduction_scales
from slipstream.engine.zero.layout import FlatLayout
from slipstream.engine.zero.ordered_launch import OrderedLauncher
from slipstream.engine.zero.param_unit import ParamUnit, UnitState
from slipstream.engine.zero.params import (
    bind_optimizer,
    broadcast_module_state,
    check_groups,
    optimizer_state_bytes,
    single_dtype,
)
from slipstream.engine.zero.offload.checkpoint_hooks import OffloadCheckpointHooks
from slipstream.engine.zero.slices import OwnedSlice, ParamSlice
from slipstream.engine.zero.storage import alias, copy_pieces
from slipstream.engine.zero.strategy import (
    OptimizerFactory,
    ParamGroupSpec,
    ShardingOptions,
    ShardingStrategy,
)
from slipstream.engine.zero.tensor_tree import tensors_in
from slipstream.engine.zero.units import find_units
from slipstream.utils.logging import get_logger

logger = get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class Stage3Options:
    unit_classes: list[str] | None = None
    persistence_threshold: int = 100_000  # elements; smaller parameters stay gathered
    prefetch_numel: int = 50_000_000  # gather ahead while the units ahead hold fewer elements than this
    max_live_numel: int = 1_000_000_000  # never prefetch beyond this many gathered elements


@dataclasses.dataclass
class _Reduction:
    unit: ParamUnit
    work: comm.Work
    send: torch.Tensor
    receive: torch.Tensor
    accumulate: bool  # add ``receive`` into the gradient chunk once done (it landed elsewhere)


class _Pass:
    """One forward or backward walk over the block units with the gather cursor."""

    def __init__(self, order: list[ParamUnit]) -> None:
        self.order = order
        self.position = {u.index: i for i, u in enumerate(order)}
        self.cursor = 0


POOL_NUMEL = 64 * 2**20  # elements of reduce-scatter send buffers kept between units and steps

# Registry so GatheredParameters can find the unit of any partitioned parameter.
_unit_of_param: dict[int, tuple[Stage3Strategy, ParamUnit]] = {}


class Stage3Strategy(OffloadCheckpointHooks, ShardingStrategy):
    def __init__(
        self,
        module: torch.nn.Module,
        groups: list[ParamGroupSpec],
        options: ShardingOptions,
        optimizer: torch.optim.Optimizer | OptimizerFactory,
        stage3: Stage3Options,
        preshard: Callable[[FlatLayout], torch.Tensor] | None = None,
    ) -> None:
        self.module, self.options, self.stage3, self.group = module, options, stage3, options.group
        self.world, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        specs = find_units(module, stage3.unit_classes, stage3.persistence_threshold)
        self.managed = [p for spec in specs for p in spec.params]
        self.names = {id(p): n for n, p in module.named_parameters()}
        self.trainable = [p for p in self.managed if p.requires_grad]
        self.index = {id(p): i for i, p in enumerate(self.trainable)}
        check_groups(groups, self.index, self.names)
        self.dtype = single_dtype(self.managed, 3)
        managed_index = {id(p): i for i, p in enumerate(self.managed)}
        self.layout = FlatLayout(
            [p.numel() for p in self.managed], [], 0, self.world, self.rank,
            buckets=[[managed_index[id(p)] for p in spec.params] for spec in specs],
        )  # fmt: skip
        device = self.managed[0].device if self.managed else torch.device("cpu")
        if preshard is None:
            broadcast_module_state(module, self.group)  # rank 0's weights win, as in every stage
            self.param_shard = self._shard_from_full(device)
        else:  # zero.Init built the shards without ever holding the full model
            broadcast_module_state(module, self.group, parameters=False)
            self.param_shard = preshard(self.layout).to(device=device, dtype=self.dtype)
        self.gather_group = comm.lane_group(self.group, "zero3-gather")
        self.reduce_group = comm.lane_group(self.group, "zero3-reduce")
        comm.ring_context(self.gather_group)  # set up now rather than inside a hook
        comm.ring_context(self.reduce_group)
        self.units: list[ParamUnit] = []
        for spec, bucket in zip(specs, self.layout.buckets):
            unit = ParamUnit(spec, bucket, self.layout, self.layout.shard_chunk(self.param_shard, bucket), self.gather_group)
            unit.adopt(spec.params, bucket.members)
            unit.release()
            self.units.append(unit)
            for p in spec.params:
                _unit_of_param[id(p)] = (self, unit)
        self.job_id = ""
        self.param_store = self._offload_params(device)
        gathered = [u.nbytes for u in self.units if u.kind != "persistent"]
        get_accelerator().return_freed_memory(min(gathered, default=0))
        self.blocks = [u for u in self.units if u.kind == "block"]
        self.root = next((u for u in self.units if u.kind == "root"), None)
        self.persistent = next((u for u in self.units if u.kind == "persistent"), None)
        if self.persistent is not None:
            self.persistent.refresh()
        self._bind_optimizer(optimizer, groups, device)
        # Gradient chunks only for units with trainable parameters: a frozen backbone costs no gradient memory.
        self.grad_chunks = {
            u.index: self._new_grad_chunk(u, device)
            for u in self.units if any(p.requires_grad for p in u.spec.params)
        }  # fmt: skip
        self.pre_scale, self.post_scale = reduction_scales(
            self.world, options.gradient_predivide_factor, options.prescale_gradients, options.average
        )
        reduce_order = [*reversed(self.blocks), *(u for u in (self.root, self.persistent) if u is not None)]
        self.launcher = OrderedLauncher([[u.index] for u in reduce_order], lambda i: self._launch_reduce(reduce_order[i]))
        self.reductions: list[_Reduction] = []
        self.send_pool: dict[int, list[torch.Tensor]] = {}  # numel -> reusable send buffers
        self.grad_buffers: dict[int, tuple[torch.Tensor, list[tuple[torch.Tensor, int] | None]]] = {}
        self.reduced_this_pass: set[int] = set()
        self.has_grad: set[int] = set()  # units whose gradient chunk holds something this window
        self.used = torch.zeros(len(self.trainable), dtype=torch.float32, device=device)
        self.grad32: dict[int, torch.Tensor] | None = None
        self.forward_pass: _Pass | None = None
        self.backward_pass: _Pass | None = None
        self.hooks = self._register_hooks()
        logger.debug(
            "ZeRO stage 3: %d units (%s), %d of %d elements owned by this rank",
            len(self.units), ", ".join(f"{u.spec.name}:{u.numel}" for u in self.units[:4]) + ("..." if len(self.units) > 4 else ""),
            self.layout.shard_numel, self.layout.numel,
        )  # fmt: skip
        self.zero_grad()

    # ------------------------------------------------------------------ set-up
    def _shard_from_full(self, device: torch.device) -> torch.Tensor:
        shard = torch.zeros(self.layout.shard_numel, dtype=self.dtype, device=device)
        with torch.no_grad():
            for piece in self.layout.pieces:
                copy_pieces(self.managed[piece.index].detach(), shard, [piece])
        return shard

    def _new_grad_chunk(self, unit: ParamUnit, device: torch.device) -> torch.Tensor:
        if self.offload is not None:  # NVMe optimizer offload on a CPU device: a file-backed chunk
            return self.offload.new_gradient(f"grad_{unit.index:05d}", unit.bucket.chunk, device)
        return torch.zeros(unit.bucket.chunk, dtype=self.dtype, device=device)

    def _offload_params(self, device: torch.device) -> Any:
        from slipstream.engine.zero.offload.wiring import param_store

        return param_store(self, device)

    def _bind_optimizer(self, optimizer: torch.optim.Optimizer | OptimizerFactory, groups: list[ParamGroupSpec], device: torch.device) -> None:
        self.offload = None
        if self.options.offload is not None:  # optimizer state in CPU memory or on NVMe (zero/offload/)
            from slipstream.engine.zero.offload.wiring import offload_stage3

            self.master_shard, self.master_pieces = None, []
            self.offload = offload_stage3(self, optimizer, groups, device)
            self.optimizer = self.offload.optimizer
            return
        low_precision = self.dtype != torch.float32
        self.master_shard = self.param_shard.float() if low_precision else None
        masters = self.master_shard if self.master_shard is not None else self.param_shard
        self.master_pieces: list[tuple[Any, torch.Tensor]] = []
        pieces_of: dict[int, list[torch.Tensor]] = {}
        for piece in self.layout.pieces:
            p = self.managed[piece.index]
            if id(p) in self.index:
                view = masters[piece.shard_offset : piece.shard_offset + piece.numel]
                self.master_pieces.append((piece, view))
                pieces_of.setdefault(self.index[id(p)], []).append(view)
        self.optimizer = bind_optimizer(optimizer, groups, self.index, lambda i: pieces_of.get(i, []))

    def _register_hooks(self) -> list[torch.utils.hooks.RemovableHandle]:
        hooks = [
            self.module.register_forward_pre_hook(self._begin_forward_pass, prepend=True),
            self.module.register_forward_hook(self._end_forward_pass),
        ]
        for unit in self.blocks:
            hooks.append(unit.spec.module.register_forward_pre_hook(self._unit_pre_forward(unit), with_kwargs=True))
            hooks.append(unit.spec.module.register_forward_hook(self._unit_post_forward(unit)))
        return hooks

    # ------------------------------------------------------------------ forward
    def _begin_forward_pass(self, module: torch.nn.Module, args: Any) -> None:
        self.forward_pass = _Pass(self.blocks)
        if self.root is not None:
            self.root.gather()
            self.root.wait()
        if torch.is_grad_enabled() and self.root is not None:
            self.root.pending_backward += 1
        self._prefetch(self.forward_pass)

    def _end_forward_pass(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        current, self.forward_pass = self.forward_pass, None
        if current is not None:
            self._participate_in_rest(current)
            for unit in current.order:
                if unit.depth == 0:
                    unit.release()
        if self.root is not None:
            if torch.is_grad_enabled():  # backward needs it first thing: keep it (FSDP2 keeps its root too)
                self._on_output_grad(self.root, output)
            else:
                self.root.release()
        return output

    def _unit_pre_forward(self, unit: ParamUnit) -> Callable[..., Any]:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if is_recomputing():  # see [Note: recomputation and ZeRO-3] in slipstream.checkpointing
                unit.gather()  # no depth count: a recomputation stops early, skipping post-hooks
                unit.wait()
                return None
            self._ensure(unit, self.forward_pass)
            unit.depth += 1
            if not torch.is_grad_enabled():
                return None
            unit.pending_backward += 1
            return _wrap_inputs(self, unit, args, kwargs)

        return hook

    def _unit_post_forward(self, unit: ParamUnit) -> Callable[..., Any]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
            if is_recomputing():
                return output  # stays gathered for its backward, which comes next and releases it
            unit.depth -= 1
            if unit.depth == 0:
                unit.release()
            if torch.is_grad_enabled():
                self._on_output_grad(unit, output)
            return output

        return hook

    def _on_output_grad(self, unit: ParamUnit, output: Any) -> None:
        tensors = [t for t in tensors_in(output) if t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, lambda _: self._pre_backward(unit), mode="any")

    # ------------------------------------------------------------------ gather cursor
    def _ensure(self, unit: ParamUnit, current: _Pass | None) -> None:
        """Make ``unit`` live, keeping every rank's sequence of all-gathers identical."""
        if current is not None and current.position[unit.index] >= current.cursor:
            self._advance(current, current.position[unit.index] + 1)
        else:
            unit.gather()  # repeated use (or no pass): every rank must repeat it alike
        unit.wait()
        if current is not None:
            self._prefetch(current)
            self._drop_skipped(current, current.position[unit.index])

    def _advance(self, current: _Pass, until: int) -> None:
        while current.cursor < until:
            current.order[current.cursor].gather()
            current.cursor += 1

    def _participate_in_rest(self, current: _Pass) -> None:
        """Gather the units this rank did not reach (other ranks may run them), one at a time."""
        while current.cursor < len(current.order):
            unit = current.order[current.cursor]
            current.cursor += 1
            unit.gather()
            unit.release()

    def _prefetch(self, current: _Pass) -> None:
        live = sum(u.numel for u in self.units if u.state is not UnitState.FREE)
        issued_ahead = [u for u in current.order[: current.cursor] if u.state is UnitState.GATHERING]
        ahead = sum(u.numel for u in issued_ahead)
        while current.cursor < len(current.order):
            nxt = current.order[current.cursor]
            if ahead + nxt.numel > self.stage3.prefetch_numel or live + nxt.numel > self.stage3.max_live_numel:
                return
            nxt.gather()
            ahead += nxt.numel
            live += nxt.numel
            current.cursor += 1

    def _drop_skipped(self, current: _Pass, before: int) -> None:
        """Free units the cursor passed that this rank did not run (reduce zeros for them in backward)."""
        backward = current is self.backward_pass
        for unit in current.order[:before]:
            if unit.state is UnitState.FREE or unit.depth:
                continue
            if backward and (unit.pending_backward or unit.index in self.reduced_this_pass):
                continue
            unit.release()
            if backward:
                self._finish_unit_backward(unit)

    # ------------------------------------------------------------------ backward
    def begin_backward(self, sync: bool) -> None:
        pass  # ZeRO-3 reduces every micro-step: no rank keeps a full gradient between them

    def _pre_backward(self, unit: ParamUnit) -> None:
        if self.backward_pass is None:
            self.backward_pass = _Pass(list(reversed(self.blocks)))
        if unit is self.root:
            unit.gather()
            unit.wait()
            self._prefetch(self.backward_pass)
        else:
            self._ensure(unit, self.backward_pass)
        if unit.index in self.grad_chunks and unit.index not in self.grad_buffers:
            self._attach_grad_buffer(unit)

    def _attach_grad_buffer(self, unit: ParamUnit) -> None:
        """Point the unit's ``.grad`` at its send buffer, so autograd accumulates straight into it.

        Saves allocating (and page-faulting) fresh gradient tensors and copying them out. Each
        gradient is a separate alias of the buffer with its own version counter, so a gradient that
        arrived is told from one that did not by its version.
        """
        send = self._take_send(unit.numel)
        send.zero_()
        aliases: list[tuple[torch.Tensor, int] | None] = []
        for p, i in zip(unit.spec.params, unit.bucket.members):
            if not p.requires_grad:
                aliases.append(None)
                continue
            begin, _ = unit.param_range(i)
            grad = alias(send.untyped_storage(), begin, p.shape, send.dtype)
            if p.grad is not None:  # a gradient from before this unit's backward (an outside use)
                grad.copy_(p.grad)
            p.grad = grad
            aliases.append((grad, grad._version))
        self.grad_buffers[unit.index] = (send, aliases)

    def _post_backward(self, unit: ParamUnit) -> None:
        unit.pending_backward -= 1
        if unit.pending_backward <= 0:
            unit.pending_backward = 0
            unit.release()
            self._finish_unit_backward(unit)

    def _finish_unit_backward(self, unit: ParamUnit) -> None:
        if unit.index not in self.reduced_this_pass:
            self.reduced_this_pass.add(unit.index)
            self.launcher.mark_ready(unit.index)

    def end_backward(self) -> None:
        """Complete the backward pass: every unit reduced exactly once on every rank, all freed."""
        current = self.backward_pass or _Pass(list(reversed(self.blocks)))
        self.backward_pass = current
        self._participate_in_rest(current)
        for unit in [*current.order, *(u for u in (self.root, self.persistent) if u is not None)]:
            unit.pending_backward = 0
            unit.release()
            self._finish_unit_backward(unit)
        self.launcher.flush()
        while self.reductions:
            self._complete_reduction(self.reductions.pop(0))
        self.launcher.reset()
        self.reduced_this_pass.clear()
        self.backward_pass = None

    def _take_send(self, numel: int) -> torch.Tensor:
        pooled = self.send_pool.get(numel)
        return pooled.pop() if pooled else torch.empty(numel, dtype=self.dtype, device=self.param_shard.device)

    def _launch_reduce(self, unit: ParamUnit) -> None:
        if unit.index not in self.grad_chunks:
            return  # frozen on every rank alike: nothing to reduce
        send, aliases = self.grad_buffers.pop(unit.index, (None, None))
        if send is None:
            send = self._take_send(unit.numel)
            send.zero_()
        for k, (p, i) in enumerate(zip(unit.spec.params, unit.bucket.members)):
            grad, attached = p.grad, aliases[k] if aliases is not None else None
            if attached is not None and grad is not None and grad.data_ptr() == attached[0].data_ptr():
                arrived = grad._version != attached[1]  # accumulated in place into the send buffer
            else:
                arrived = grad is not None
                begin, end = unit.param_range(i)
                if grad is not None:
                    send[begin:end].copy_(grad.reshape(-1))
                elif attached is not None:
                    send[begin:end].zero_()  # the user dropped the gradient
            p.grad = None
            if arrived and id(p) in self.index:
                self.used[self.index[id(p)]] = 1.0
        if self.pre_scale != 1.0:
            send.mul_(self.pre_scale)
        chunk = self.grad_chunks[unit.index]
        accumulate = unit.index in self.has_grad
        receive = torch.empty_like(chunk) if accumulate else chunk
        self.has_grad.add(unit.index)
        work = comm.reduce_scatter_tensor(receive, send, group=self.reduce_group, tag=f"ZeRO-3 gradients of unit {unit.index} ({unit.spec.name})")
        self.reductions.append(_Reduction(unit, work, send, receive, accumulate))
        # Bound the send buffers alive at once by reduce_bucket_size (at least the newest one).
        while len(self.reductions) > 1 and sum(r.send.numel() for r in self.reductions) > self.options.reduce_bucket_numel:
            self._complete_reduction(self.reductions.pop(0))

    def _complete_reduction(self, reduction: _Reduction) -> None:
        reduction.work.wait()
        if reduction.accumulate:
            self.grad_chunks[reduction.unit.index].add_(reduction.receive)
        # Keep the send buffer for the next unit of this size: a fresh one costs page faults every time.
        # Bounded (POOL_NUMEL in all): with billion-parameter models two buffers per unit size held
        # ~1 GB per rank between steps, more than the faults it saves are worth.
        pooled = self.send_pool.setdefault(reduction.send.numel(), [])
        held = sum(t.numel() for pool in self.send_pool.values() for t in pool)
        if len(pooled) < 2 and held + reduction.send.numel() <= POOL_NUMEL:
            pooled.append(reduction.send)

    def finish_gradients(self) -> None:
        if self.post_scale != 1.0:
            for chunk in self.grad_chunks.values():
                chunk.mul_(self.post_scale)
        comm.all_reduce(self.used, op=dist.ReduceOp.MAX, group=self.group, tag="used-parameter flags").wait()
        if self.offload is not None:
            self.offload.gradients_ready(self.used)
        elif self.master_shard is not None:
            self.grad32 = {i: chunk.float() for i, chunk in self.grad_chunks.items()}
        grads = self._owned_grads()
        for piece, master in self.master_pieces:
            used = self.used[self.index[id(self.managed[piece.index])]]
            bucket = self.layout.buckets[self.layout.slots[piece.index].bucket]
            begin = piece.shard_offset - bucket.shard_offset
            master.grad = grads[bucket.index][begin : begin + piece.numel] if used else None

    # ------------------------------------------------------------------ step
    def _owned_grads(self) -> dict[int, torch.Tensor]:
        return self.grad32 if self.grad32 is not None else self.grad_chunks

    def global_grad_norm(self) -> torch.Tensor:
        squared = torch.zeros(1, dtype=torch.float32, device=self.used.device)
        for chunk in self._owned_grads().values():
            squared += torch.linalg.vector_norm(chunk, dtype=torch.float32) ** 2
        comm.all_reduce(squared, group=self.group, tag="gradient norm").wait()
        return squared.sqrt()[0]

    def scale_gradients(self, factor: float) -> None:
        if self.offload is not None:
            self.offload.grad_scale = factor  # applied by the CPU Adam as it reads each gradient
            return
        if factor != 1.0:
            for chunk in self._owned_grads().values():
                chunk.mul_(factor)

    def step(self) -> None:
        self.optimizer.step()
        with torch.no_grad():
            if self.master_shard is not None:
                self.param_shard.copy_(self.master_shard)
            if self.persistent is not None:
                self.persistent.refresh()

    def zero_grad(self) -> None:
        for chunk in self.grad_chunks.values():
            chunk.zero_()
        self.has_grad.clear()
        self.grad32 = None
        if self.offload is not None:
            self.offload.zero_grad()
        for p in self.managed:
            p.grad = None
        for _, master in self.master_pieces:
            master.grad = None
        self.used.zero_()

    # ------------------------------------------------------------------ gathered access
    def gathered(self, units: list[ParamUnit]) -> None:
        for unit in sorted(units, key=lambda u: u.index):
            unit.gather()
        for unit in units:
            unit.wait()

    def repartition(self, units: list[ParamUnit], modifier_rank: int | None) -> None:
        """After a GatheredParameters block: adopt ``modifier_rank``'s values, then free."""
        for unit in sorted(units, key=lambda u: u.index):
            if modifier_rank is not None:
                comm.broadcast(unit.flat, src=dist.get_global_rank(self.group, modifier_rank) if self.group else modifier_rank,
                               group=self.group, tag=f"GatheredParameters unit {unit.index}").wait()  # fmt: skip
                if self.offload is not None:
                    self.param_store.modified(unit, unit.own_chunk())
                    self.offload.store.write("master", unit.bucket.shard_offset, unit.own_chunk().float().cpu())
                else:
                    unit.shard.copy_(unit.own_chunk())
                if self.master_shard is not None:
                    self.layout.shard_chunk(self.master_shard, unit.bucket).copy_(unit.shard)
            if unit.kind == "persistent":
                continue
            unit.release()

    # ------------------------------------------------------------------ state
    def consolidated_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Gathers one unit at a time, so ranks other than 0 never hold more than one unit in full."""
        masters = self.master_shard if self.master_shard is not None else self.param_shard
        state: dict[str, torch.Tensor] = {}
        for unit in self.units:
            flat = torch.empty(unit.numel, dtype=torch.float32, device=self.param_shard.device)
            own = flat.view(self.world, -1)[self.rank]
            if self.offload is not None:
                own.copy_(self.offload.masters(unit.bucket.shard_offset, unit.bucket.shard_offset + unit.bucket.chunk))
            else:
                own.copy_(self.layout.shard_chunk(masters, unit.bucket))
            comm.all_gather_into_tensor(flat, own, group=self.group, tag=f"fp32 weights of unit {unit.index}").wait()
            if self.rank == 0:
                for p, i in zip(unit.spec.params, unit.bucket.members):
                    begin, end = unit.param_range(i)
                    state[self.names[id(p)]] = flat[begin:end].view(p.shape).clone()
        if self.rank != 0:
            return None
        return {name: state[name] for name, _ in self.module.named_parameters()}  # the model's order

    def sharded_state(self) -> list[OwnedSlice]:
        if self.offload is not None:  # masters and Adam state live in the offload store
            from slipstream.engine.zero.offload.checkpoint import offload_slices

            pieces = [(piece, self.managed[piece.index]) for piece in self.layout.pieces]
            return offload_slices(self.offload, [
                (ParamSlice(self.names[id(p)], tuple(p.shape), piece.param_offset, piece.numel), piece.shard_offset)
                for piece, p in pieces
            ])  # fmt: skip
        masters = self.master_shard if self.master_shard is not None else self.param_shard
        optimized = {piece.shard_offset: view for piece, view in self.master_pieces}
        owned = []
        for piece in self.layout.pieces:  # frozen parameters too: they are partitioned like the rest
            p = self.managed[piece.index]
            view = optimized.get(piece.shard_offset)
            value = view if view is not None else masters[piece.shard_offset : piece.shard_offset + piece.numel]
            owned.append(OwnedSlice(ParamSlice(self.names[id(p)], tuple(p.shape), piece.param_offset, piece.numel), value, view))
        return owned

    def refresh_from_masters(self) -> None:
        with torch.no_grad():
            if self.offload is not None:  # into the parameter shards: device, CPU or NVMe (param_store.py)
                self.offload.publish_masters()
            if self.master_shard is not None:
                self.param_shard.copy_(self.master_shard)
            if self.persistent is not None:
                self.persistent.refresh()

    def memory_breakdown(self) -> dict[str, int]:
        persistent = self.persistent.nbytes if self.persistent is not None else 0
        live = sum(u.nbytes for u in self.units if u.state is not UnitState.FREE and u is not self.persistent)
        live += sum(t.numel() * t.element_size() for pool in self.send_pool.values() for t in pool)
        masters = 0 if self.master_shard is None else self.master_shard.numel() * 4
        offloaded = self.offload.memory_bytes() if self.offload is not None else 0  # CPU memory (NVMe: buffers only)
        return {
            "params": self.param_store.memory_bytes() + persistent,
            "grads": sum(c.numel() * c.element_size() for c in self.grad_chunks.values()),
            "optimizer": optimizer_state_bytes(self.optimizer) + masters + offloaded,
            "buffers": live,
        }

    def close(self) -> None:
        """Remove the hooks and give every parameter its full value back as an ordinary tensor."""
        super().close()
        for unit in self.units:
            unit.gather()
            unit.wait()
            for p, i in zip(unit.spec.params, unit.bucket.members):
                begin, end = unit.param_range(i)
                p.data = unit.full[begin:end].view(p.shape).clone()
                _unit_of_param.pop(id(p), None)
            unit.full.untyped_storage().resize_(0)
            unit.state = UnitState.FREE
        if self.offload is not None:
            self.offload.close()
        self.param_store.close()


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once the unit's own backward is done."""

    @staticmethod
    def forward(ctx: Any, strategy: Stage3Strategy, unit: ParamUnit, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.strategy, ctx.unit = strategy, unit
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.strategy._post_backward(ctx.unit)
        return (None, None, *grads)


def _wrap_inputs(strategy: Stage3Strategy, unit: ParamUnit, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    flat = [(k, v) for k, v in enumerate(args) if isinstance(v, torch.Tensor) and v.requires_grad]
    named = [(k, v) for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
    if not flat and not named:
        return None
    wrapped = _PostBackward.apply(strategy, unit, *(v for _, v in flat), *(v for _, v in named))
    new_args = list(args)
    for (k, _), t in zip(flat, wrapped[: len(flat)]):
        new_args[k] = t
    new_kwargs = dict(kwargs)
    for (k, _), t in zip(named, wrapped[len(flat) :]):
        new_kwargs[k] = t
    return tuple(new_args), new_kwargs
