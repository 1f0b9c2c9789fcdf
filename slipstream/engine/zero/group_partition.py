"""One sharding group's share of ZeRO-1/2: flat parameters, gradients reduce-scattered per bucket,
updated chunks all-gathered back.

Parameters (in the model's dtype) become views into one flat buffer laid out by
:class:`FlatLayout` over the group's ranks. The partition occupies ``[base, base + numel)`` of
this rank's partition coordinates (several groups' partitions are concatenated, see
``partition.py``), which is where its pieces, gradients and parameters are addressed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from slipstream import comm
from slipstream.comm.context import CommContext
from slipstream.engine.zero.arrivals import Hooked, attach
from slipstream.engine.zero.flat_layout import FlatLayout
from slipstream.engine.zero.grad_buckets import reduction_scales
from slipstream.engine.zero.grad_storage import GradientStorage, InFlight
from slipstream.engine.zero.offload.chunks import Chunks
from slipstream.engine.zero.ordered_launch import OrderedLauncher
from slipstream.engine.zero.strategy import ShardingOptions

StorageFactory = Callable[[FlatLayout, dict[int, InFlight]], GradientStorage]


class GroupPartition:
    def __init__(
        self,
        group: dist.ProcessGroup | None,
        trainable: list[torch.nn.Parameter],
        members: list[list[int]],
        options: ShardingOptions,
        storage: StorageFactory,
        base: int,
        dtype: torch.dtype,
        device: torch.device,
        context: CommContext | None = None,
    ) -> None:
        """``members``: indices into ``trainable`` per optimizer group sharded over ``group``; ``context``: the strategy's."""
        self.group, self.options, self.base = group, options, base
        self.context = context if context is not None else CommContext()
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.layout = FlatLayout(
            [p.numel() for p in trainable], members, options.reduce_bucket_numel, self.world, self.rank
        )
        self.indices = sorted({i for ms in members for i in ms})
        self.numel = self.layout.shard_numel
        self.flat_params = torch.zeros(self.layout.numel, dtype=dtype, device=device)
        with torch.no_grad():  # before any autograd graph exists
            for i in self.indices:
                view = self.layout.param_view(self.flat_params, i, trainable[i].shape)
                view.copy_(trainable[i].detach())
                trainable[i].data = view
        self.inflight: dict[int, InFlight] = {}
        self.grads = storage(self.layout, self.inflight)
        self.communication_dtype = (
            options.communication_dtype if options.communication_dtype not in (None, dtype) else None
        )
        self.pre_scale, self.post_scale = reduction_scales(
            self.world, options.gradient_predivide_factor, options.prescale_gradients, options.average
        )
        comm.ring_context(group)  # collective set-up, done now rather than inside a backward hook
        self.launcher = OrderedLauncher([b.members for b in self.layout.buckets], self._launch)

    # ------------------------------------------------------------------ coordinates
    def params(self) -> Chunks:
        return Chunks(
            [self.base + b.shard_offset for b in self.layout.buckets],
            [self.layout.own_chunk(self.flat_params, b) for b in self.layout.buckets],
        )

    def boundaries(self) -> list[int]:
        return [self.base + b.shard_offset for b in self.layout.buckets]

    # ------------------------------------------------------------------ gradients
    def attach(self, trainable: list[torch.nn.Parameter], used: bytearray) -> Hooked:
        """Hooks on this partition's parameters: each arrival marks ``used``, keeps the gradient where the storage
        wants it, and counts its bucket down to the launch ([Note: arrivals in C++] in arrivals.py)."""
        self.arrivals = attach(
            [trainable[i] for i in self.indices],
            self.indices,
            self.grads.arrival_views(self.indices),
            self.grads.arrival,
            [self.launcher.bucket_of[i] for i in self.indices],
            len(self.layout.buckets),
            used,
            self.launcher.complete,
            self.launcher.twice,
        )
        self.arrivals.launch = self.options.overlap_comm
        return self.arrivals

    def _launch(self, index: int, waited: bool = False) -> None:
        bucket = self.layout.buckets[index]
        send, pooled = self.grads.send(bucket)
        if self.pre_scale != 1.0:
            send.mul_(self.pre_scale)
        if self.communication_dtype is not None:
            send = send.to(self.communication_dtype)
            receive = torch.empty(bucket.chunk, dtype=send.dtype, device=send.device)
        else:
            receive = self.grads.chunk(bucket)  # straight into place (stage 1: in place in the input)
        tag = f"gradient bucket {index}"
        work = self.context.issue(
            "reduce_scatter",
            lambda: comm.reduce_scatter_tensor(receive, send, group=self.group, tag=tag, inline=waited),
            tag,
        )
        self.inflight[index] = InFlight(work, send, receive, pooled)

    def finish(self) -> None:
        """Launch what is left (in order), wait for every bucket and leave the averaged chunks in place."""
        self.launcher.flush()
        for index, bucket in enumerate(self.layout.buckets):
            self.inflight[index].work.wait()
            destination, receive = self.grads.chunk(bucket), self.inflight[index].receive
            if receive.data_ptr() != destination.data_ptr():
                destination.copy_(receive)
            if self.post_scale != 1.0:
                destination.mul_(self.post_scale)
        self.grads.reductions_done()
        self.inflight.clear()

    def zero_grad(self) -> None:
        self.grads.zero()
        self.launcher.reset()
        self.arrivals.reset()

    # ------------------------------------------------------------------ weights
    def write_own(self, flat: torch.Tensor, values: Callable[[int, int], torch.Tensor]) -> None:
        """Fill this rank's chunks of ``flat`` (a full-size buffer) with ``values(lo, hi)`` (partition coordinates)."""
        for bucket in self.layout.buckets:
            lo = self.base + bucket.shard_offset
            self.layout.own_chunk(flat, bucket).copy_(values(lo, lo + bucket.chunk))

    def all_gather(self, flat: torch.Tensor, what: str) -> None:
        """Every rank's chunks of ``flat`` to every rank, one collective per bucket."""
        works = []
        for bucket in self.layout.buckets:
            mine = self.layout.own_chunk(flat, bucket)  # in place: comm handles the aliasing
            whole, tag = self.layout.bucket_view(flat, bucket), f"{what}, bucket {bucket.index}"
            works.append(
                self.context.issue(
                    "all_gather",
                    lambda whole=whole, mine=mine, tag=tag: comm.all_gather_into_tensor(
                        whole, mine, group=self.group, tag=tag, inline=True
                    ),
                    tag,
                )
            )
        for work in works:
            work.wait()

    def param_view(self, flat: torch.Tensor, i: int, shape: torch.Size) -> torch.Tensor:
        return self.layout.param_view(flat, i, shape)
