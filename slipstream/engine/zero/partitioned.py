"""ZeRO stages 1 and 2: optimizer state (1) and gradients too (2) partitioned across ranks.

Parameters (in the model's dtype) become views into one flat buffer laid out by
:class:`FlatLayout`. Each rank keeps fp32 master weights and optimizer state only for its chunks.

* Stage 1 keeps full-size gradients (``param.grad`` are views into a flat buffer, accumulated in
  place); at the boundary each bucket is reduce-scattered and a rank keeps only its chunk.
* Stage 2 keeps no full-size gradient buffer: when a bucket's gradients are complete they are
  packed, reduce-scattered into the rank's gradient shard and the full gradients freed at once.
  With gradient accumulation the full gradients accumulate locally between boundaries (one
  collective per optimizer step instead of one per micro-step).

After the step the updated chunks return to every rank with one all-gather per bucket.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from slipstream import comm
from slipstream.engine.zero.grad_buckets import reduction_scales
from slipstream.engine.zero.layout import FlatLayout, LayoutBucket
from slipstream.engine.zero.ordered_launch import OrderedLauncher
from slipstream.engine.zero.params import TrainableParams, adopt_grad, bind_optimizer, optimizer_state_bytes, single_dtype
from slipstream.engine.zero.offload.checkpoint_hooks import OffloadCheckpointHooks
from slipstream.engine.zero.slices import OwnedSlice, ParamSlice
from slipstream.engine.zero.strategy import OptimizerFactory, ParamGroupSpec, ShardingOptions, ShardingStrategy
from slipstream.utils.logging import get_logger

logger = get_logger(__name__)


@dataclasses.dataclass
class _InFlight:
    work: comm.Work
    send: torch.Tensor  # keeps the input alive until the collective completes
    receive: torch.Tensor  # where the reduced chunk lands
    pooled: torch.Tensor | None = None  # the pool buffer behind ``send``, returned once the work is done


class SendBuffers:
    """Stage 2's double-buffered send buffers, reused every step so the allocator never churns.

    A bucket takes a buffer when its first gradient arrives. With both buffers taken, the oldest
    launched bucket is waited for and its buffer reused; if neither has launched yet (buckets
    blocked behind an unused parameter, or overlap_comm off) a temporary buffer is allocated.
    """

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, count: int = 2) -> None:
        self.free = [torch.empty(numel, dtype=dtype, device=device) for _ in range(count)]
        self.total_bytes = sum(t.numel() * t.element_size() for t in self.free)
        self.dtype, self.device = dtype, device

    def acquire(self, numel: int, inflight: dict[int, _InFlight]) -> tuple[torch.Tensor, torch.Tensor | None]:
        base = self.free.pop() if self.free else self._reclaim(inflight)
        if base is None:
            return torch.zeros(numel, dtype=self.dtype, device=self.device), None
        view = base[:numel]
        view.zero_()
        return view, base

    @staticmethod
    def _reclaim(inflight: dict[int, _InFlight]) -> torch.Tensor | None:
        for index in sorted(inflight):
            flight = inflight[index]
            if flight.pooled is not None:
                flight.work.wait()
                base, flight.pooled = flight.pooled, None
                return base
        return None

    def release_all(self, inflight: dict[int, _InFlight]) -> None:
        for flight in inflight.values():
            if flight.pooled is not None:
                self.free.append(flight.pooled)
                flight.pooled = None


class PartitionedStrategy(OffloadCheckpointHooks, ShardingStrategy):
    def __init__(
        self,
        module: torch.nn.Module,
        groups: list[ParamGroupSpec],
        options: ShardingOptions,
        optimizer: torch.optim.Optimizer | OptimizerFactory,
        stage: int,
    ) -> None:
        if stage not in (1, 2):
            raise ValueError(f"PartitionedStrategy implements ZeRO stages 1 and 2, got {stage}")
        self.stage, self.options, self.group, self.module = stage, options, options.group, module
        params = TrainableParams(module, groups, self.group)
        self.names, self.trainable, self.index = params.names, params.trainable, params.index
        self.dtype = single_dtype(self.trainable, stage)
        self.low_precision = self.dtype != torch.float32
        self.world, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        group_members = [[self.index[id(p)] for p in g.params if id(p) in self.index] for g in groups]
        self.layout = FlatLayout(
            [p.numel() for p in self.trainable], group_members, options.reduce_bucket_numel, self.world, self.rank
        )
        self.in_layout = {i for members in group_members for i in members}
        device = self.trainable[0].device if self.trainable else torch.device("cpu")
        self.flat_params = self._adopt_parameters(device)
        offloaded = options.offload is not None and options.offload.optimizer != "none"
        self.master_shard = None if offloaded else self._make_master_shard(device)
        self.master_pieces = [] if offloaded else [self._master_piece(piece) for piece in self.layout.pieces]
        pieces_of: dict[int, list[torch.Tensor]] = {}
        for piece, master in zip(self.layout.pieces, self.master_pieces):
            pieces_of.setdefault(piece.index, []).append(master)
        if not offloaded:
            self.optimizer = bind_optimizer(optimizer, groups, self.index, lambda i: pieces_of.get(i, []))
        if stage == 1:
            self.flat_grads = torch.zeros(self.layout.numel, dtype=self.dtype, device=device)
            self.grad_views = [self.layout.param_view(self.flat_grads, i, p.shape) if i in self.in_layout else None
                               for i, p in enumerate(self.trainable)]  # fmt: skip
        else:
            self.grad_shard = torch.zeros(self.layout.shard_numel, dtype=self.dtype, device=device)
            largest = max((b.numel for b in self.layout.buckets), default=0)
            self.send_pool = SendBuffers(largest, self.dtype, device, count=2 if options.overlap_comm else 1)
        self.communication_dtype = options.communication_dtype if options.communication_dtype not in (None, self.dtype) else None
        self.pre_scale, self.post_scale = reduction_scales(
            self.world, options.gradient_predivide_factor, options.prescale_gradients, options.average
        )
        comm.ring_context(self.group)  # collective set-up, done now rather than inside a backward hook
        self.launcher = OrderedLauncher([b.members for b in self.layout.buckets], self._launch)
        self.inflight: dict[int, _InFlight] = {}
        self.send_buffers: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # bucket -> (send, pool base)
        self.used = torch.zeros(len(self.trainable), dtype=torch.float32, device=device)
        self.grad32: torch.Tensor | None = None
        self.sync = False
        self.offload = None
        if offloaded:
            from slipstream.engine.zero.offload.wiring import offload_partitioned

            self.offload = offload_partitioned(self, optimizer, groups)
            self.optimizer = self.offload.optimizer
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.trainable]
        logger.debug(
            "ZeRO stage %d: %d buckets, %d of %d elements owned by this rank",
            stage, len(self.layout.buckets), self.layout.shard_numel, self.layout.numel,
        )  # fmt: skip
        self.zero_grad()

    # ------------------------------------------------------------------ set-up
    def _adopt_parameters(self, device: torch.device) -> torch.Tensor:
        """Move every trainable parameter into the flat buffer (before any autograd graph exists)."""
        flat = torch.zeros(self.layout.numel, dtype=self.dtype, device=device)
        with torch.no_grad():
            for i in sorted(self.in_layout):
                p = self.trainable[i]
                view = self.layout.param_view(flat, i, p.shape)
                view.copy_(p.detach())
                p.data = view
        return flat

    def _make_master_shard(self, device: torch.device) -> torch.Tensor | None:
        if not self.low_precision:
            return None  # fp32: this rank's chunks of the parameters are the masters
        shard = torch.empty(self.layout.shard_numel, dtype=torch.float32, device=device)
        for bucket in self.layout.buckets:
            self.layout.shard_chunk(shard, bucket).copy_(self.layout.own_chunk(self.flat_params, bucket))
        return shard

    def _master_piece(self, piece: Any) -> torch.Tensor:
        if self.master_shard is not None:
            return self.master_shard[piece.shard_offset : piece.shard_offset + piece.numel]
        slot = self.layout.slots[piece.index]
        start = slot.start + piece.param_offset
        return self.flat_params[start : start + piece.numel]

    # ------------------------------------------------------------------ backward
    def begin_backward(self, sync: bool) -> None:
        self.sync = sync

    def _on_grad(self, param: torch.Tensor) -> None:
        i = self.index[id(param)]
        if i not in self.in_layout:
            return
        if self.stage == 1:
            adopt_grad(param, self.grad_views[i])
        self.used[i] = 1.0
        if self.sync:
            if self.stage == 2:
                self._pack(i, param)
            self.launcher.mark_ready(i, launch=self.options.overlap_comm)

    def _pack(self, i: int, param: torch.Tensor) -> None:
        """Stage 2: move a finished gradient into its bucket's send buffer and free it at once."""
        slot = self.layout.slots[i]
        bucket = self.layout.buckets[slot.bucket]
        send = self._send_buffer(bucket)[0]
        send[slot.start - bucket.start : slot.start - bucket.start + slot.numel].copy_(param.grad.view(-1))
        param.grad = None

    def _launch(self, index: int) -> None:
        bucket = self.layout.buckets[index]
        pooled = None
        if self.stage == 1:
            send = self.layout.bucket_view(self.flat_grads, bucket)
        else:  # gradients nobody produced (unused parameters, padding) stay zero
            for i in bucket.members:  # used in an earlier micro-step of this window but not in the last
                if self.trainable[i].grad is not None:
                    self._pack(i, self.trainable[i])
            send, pooled = self._send_buffer(bucket)
            del self.send_buffers[index]
        if self.pre_scale != 1.0:
            send.mul_(self.pre_scale)
        if self.communication_dtype is not None:
            send = send.to(self.communication_dtype)
        if self.communication_dtype is None:
            receive = self._grad_chunk(bucket)  # straight into place (stage 1: in place in the input)
        else:
            receive = torch.empty(bucket.chunk, dtype=send.dtype, device=send.device)
        work = comm.reduce_scatter_tensor(receive, send, group=self.group, tag=f"gradient bucket {index}")
        self.inflight[index] = _InFlight(work, send, receive, pooled)

    def _send_buffer(self, bucket: LayoutBucket) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Stage 2: the bucket's send buffer (and its pool base), taken when first needed."""
        if bucket.index not in self.send_buffers:
            self.send_buffers[bucket.index] = self.send_pool.acquire(bucket.numel, self.inflight)
        return self.send_buffers[bucket.index]

    def _grad_chunk(self, bucket: LayoutBucket) -> torch.Tensor:
        """Where this rank's reduced gradient chunk of ``bucket`` is kept."""
        if self.stage == 1:
            return self.layout.own_chunk(self.flat_grads, bucket)
        return self.layout.shard_chunk(self.grad_shard, bucket)

    def finish_gradients(self) -> None:
        self.launcher.flush()
        for index, bucket in enumerate(self.layout.buckets):
            self.inflight[index].work.wait()
            destination, receive = self._grad_chunk(bucket), self.inflight[index].receive
            if receive.data_ptr() != destination.data_ptr():
                destination.copy_(receive)
            if self.post_scale != 1.0:
                destination.mul_(self.post_scale)
        if self.stage == 2:
            self.send_pool.release_all(self.inflight)
        self.inflight.clear()
        comm.all_reduce(self.used, op=dist.ReduceOp.MAX, group=self.group, tag="used-parameter flags").wait()
        if self.offload is not None:
            self.offload.gradients_ready(self.used)
        elif self.low_precision:
            self.grad32 = torch.empty(self.layout.shard_numel, dtype=torch.float32, device=self.flat_params.device)
            for bucket in self.layout.buckets:
                self.layout.shard_chunk(self.grad32, bucket).copy_(self._grad_chunk(bucket))
        for piece, master in zip(self.layout.pieces, self.master_pieces):
            master.grad = self._piece_grad(piece) if self.used[piece.index] else None
        self.sync = False

    def _piece_grad(self, piece: Any) -> torch.Tensor:
        if self.grad32 is not None:
            return self.grad32[piece.shard_offset : piece.shard_offset + piece.numel]
        if self.stage == 2:
            return self.grad_shard[piece.shard_offset : piece.shard_offset + piece.numel]
        start = self.layout.slots[piece.index].start + piece.param_offset
        return self.flat_grads[start : start + piece.numel]

    def _owned_grads(self) -> list[torch.Tensor]:
        if self.grad32 is not None:
            return [self.grad32]
        return [self._grad_chunk(b) for b in self.layout.buckets]

    # ------------------------------------------------------------------ step
    def global_grad_norm(self) -> torch.Tensor:
        zero = torch.zeros((), device=self.flat_params.device)
        local = sum((torch.linalg.vector_norm(g, dtype=torch.float32) ** 2 for g in self._owned_grads()), zero)
        squared = local.reshape(1).to(torch.float32)
        comm.all_reduce(squared, group=self.group, tag="gradient norm").wait()
        return squared.sqrt()[0]

    def scale_gradients(self, factor: float) -> None:
        if self.offload is not None:
            self.offload.grad_scale = factor  # applied by the CPU Adam as it reads each gradient
            return
        if factor != 1.0:
            for g in self._owned_grads():
                g.mul_(factor)

    def step(self) -> None:
        self.optimizer.step()  # with offload, also writes the updated parameters into flat_params
        with torch.no_grad():
            if self.master_shard is not None:
                for bucket in self.layout.buckets:
                    self.layout.own_chunk(self.flat_params, bucket).copy_(self.layout.shard_chunk(self.master_shard, bucket))
            self._all_gather(self.flat_params, "updated weights")

    def _all_gather(self, flat: torch.Tensor, what: str) -> None:
        works = []
        for bucket in self.layout.buckets:
            mine = self.layout.own_chunk(flat, bucket)  # in place: comm handles the aliasing
            works.append(
                comm.all_gather_into_tensor(self.layout.bucket_view(flat, bucket), mine, group=self.group, tag=f"{what}, bucket {bucket.index}")
            )  # fmt: skip
        for work in works:
            work.wait()

    def zero_grad(self) -> None:
        if self.stage == 1:
            self.flat_grads.zero_()
            for p, view in zip(self.trainable, self.grad_views):
                p.grad = view
        else:
            self.grad_shard.zero_()
            for p in self.trainable:
                p.grad = None
        for master in self.master_pieces:
            master.grad = None
        self.grad32 = None
        if self.offload is not None:
            self.offload.zero_grad()
        if self.stage == 2:
            for _, base in self.send_buffers.values():
                if base is not None:
                    self.send_pool.free.append(base)
            self.send_buffers.clear()
        self.launcher.reset()
        self.used.zero_()

    # ------------------------------------------------------------------ state
    def consolidated_state_dict(self) -> dict[str, torch.Tensor] | None:
        if self.master_shard is not None or (self.offload is not None and self.low_precision):
            full = torch.zeros(self.layout.numel, dtype=torch.float32, device=self.flat_params.device)
            for bucket in self.layout.buckets:
                if self.offload is not None:
                    masters = self.offload.masters(bucket.shard_offset, bucket.shard_offset + bucket.chunk)
                else:
                    masters = self.layout.shard_chunk(self.master_shard, bucket)
                self.layout.own_chunk(full, bucket).copy_(masters)
            self._all_gather(full, "fp32 master weights")
        else:
            full = self.flat_params
        if self.rank != 0:
            return None
        state = {}
        for name, p in self.module.named_parameters():
            i = self.index.get(id(p))
            value = self.layout.param_view(full, i, p.shape) if i in self.in_layout else p
            state[name] = value.detach().float().clone()
        return state

    def sharded_state(self) -> list[OwnedSlice]:
        names = {id(p): n for n, p in self.module.named_parameters()}
        owned = []
        if self.offload is not None:  # masters and Adam state live in the offload store
            from slipstream.engine.zero.offload.checkpoint import offload_slices

            shape_of = [(names[id(p)], tuple(p.shape)) for p in self.trainable]
            owned = offload_slices(self.offload, [(ParamSlice(*shape_of[piece.index], piece.param_offset, piece.numel), piece.shard_offset)
                                                  for piece in self.layout.pieces])  # fmt: skip
        for piece, master in zip(self.layout.pieces, self.master_pieces):
            p = self.trainable[piece.index]
            owned.append(OwnedSlice(ParamSlice(names[id(p)], tuple(p.shape), piece.param_offset, piece.numel), master, master))
        for name, p in self.module.named_parameters():  # frozen or outside every optimizer group: replicated
            if self.index.get(id(p)) not in self.in_layout:
                owned.append(OwnedSlice(ParamSlice(name, tuple(p.shape), 0, p.numel()), p.detach().view(-1), None, replicated=True))
        return owned

    def refresh_from_masters(self) -> None:
        with torch.no_grad():
            if self.offload is not None:
                self.offload.publish_masters()  # into this rank's chunks of flat_params
            if self.master_shard is not None:
                for bucket in self.layout.buckets:
                    self.layout.own_chunk(self.flat_params, bucket).copy_(self.layout.shard_chunk(self.master_shard, bucket))
            self._all_gather(self.flat_params, "loaded weights")

    def memory_breakdown(self) -> dict[str, int]:
        grads = self.flat_grads if self.stage == 1 else self.grad_shard
        optimizer_state = optimizer_state_bytes(self.optimizer)
        masters = 0 if self.master_shard is None else self.master_shard.numel() * 4
        if self.offload is not None:
            optimizer_state = self.offload.memory_bytes()  # in CPU memory; on NVMe only the swap buffers
        return {
            "params": self.flat_params.numel() * self.flat_params.element_size(),
            "grads": grads.numel() * grads.element_size(),
            "optimizer": optimizer_state + masters,
            "buffers": self.send_pool.total_bytes if self.stage == 2 else 0,
        }


    def close(self) -> None:
        super().close()
        if self.offload is not None:
            self.offload.close()
