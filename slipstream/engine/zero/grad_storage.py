"""Where a ZeRO-1/2 partition keeps its gradients: the one thing that differs between the stages.

* :class:`FullGradients` (stage 1): a full-size flat buffer; ``param.grad`` are views into it
  (autograd accumulates in place) and each bucket reduce-scatters in place, so this rank's
  chunk of the buffer ends up holding the averaged gradient.
* :class:`ShardedGradients` (stage 2): only this rank's gradient shard persists. On the boundary
  micro-step a bucket's gradients are packed into its send buffer when it launches and freed
  ([Note: packed at launch]); the bucket reduce-scatters into the shard. Between boundaries
  gradients accumulate in ``.grad``.
"""

from __future__ import annotations

import abc
import dataclasses

import torch

from slipstream import comm
from slipstream.comm.context import Pending
from slipstream.engine.zero.arrivals import ADOPT, COUNT
from slipstream.engine.zero.flat_layout import FlatLayout, LayoutBucket
from slipstream.engine.zero.offload.chunks import Chunks


@dataclasses.dataclass
class InFlight:
    work: comm.Work | Pending
    send: torch.Tensor  # keeps the input alive until the collective completes
    receive: torch.Tensor  # where the reduced chunk lands
    pooled: torch.Tensor | None = None  # the pool buffer behind ``send``, returned once the work is done


class GradientStorage(abc.ABC):
    def __init__(
        self, layout: FlatLayout, params: list[torch.nn.Parameter], dtype: torch.dtype, device: torch.device
    ) -> None:
        self.layout, self.params, self.dtype, self.device = layout, params, dtype, device

    arrival = COUNT  # what a gradient's arrival does to it (arrivals.py): left where autograd put it

    def arrival_views(self, indices: list[int]) -> list[torch.Tensor]:
        """Where the gradients of parameters ``indices`` are kept (for ``arrival = ADOPT``)."""
        return []

    @abc.abstractmethod
    def send(self, bucket: LayoutBucket) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The bucket's gradients ready to reduce-scatter, and the pooled buffer behind them (if any)."""

    @abc.abstractmethod
    def chunk(self, bucket: LayoutBucket) -> torch.Tensor:
        """Where this rank's reduced chunk of ``bucket`` is kept."""

    def chunks(self, base: int) -> Chunks:
        """The reduced chunks in partition coordinates (this partition starts at ``base``)."""
        buckets = self.layout.buckets
        return Chunks([base + b.shard_offset for b in buckets], [self.chunk(b) for b in buckets])

    def reductions_done(self) -> None:
        """Every reduction of the window completed."""

    @abc.abstractmethod
    def zero(self) -> None: ...

    @abc.abstractmethod
    def nbytes(self) -> int: ...

    def buffer_bytes(self) -> int:
        return 0


class FullGradients(GradientStorage):
    def __init__(
        self, layout: FlatLayout, params: list[torch.nn.Parameter], dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__(layout, params, dtype, device)
        self.flat = torch.zeros(layout.numel, dtype=dtype, device=device)
        self.views = {i: layout.param_view(self.flat, i, params[i].shape) for b in layout.buckets for i in b.members}

    arrival = ADOPT  # .grad is a view into the flat buffer: autograd accumulates in place

    def arrival_views(self, indices: list[int]) -> list[torch.Tensor]:
        return [self.views[i] for i in indices]

    def send(self, bucket: LayoutBucket) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.layout.bucket_view(self.flat, bucket), None

    def chunk(self, bucket: LayoutBucket) -> torch.Tensor:
        return self.layout.own_chunk(self.flat, bucket)

    def zero(self) -> None:
        self.flat.zero_()
        for i, view in self.views.items():
            self.params[i].grad = view

    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


class ShardedGradients(GradientStorage):
    def __init__(
        self,
        layout: FlatLayout,
        params: list[torch.nn.Parameter],
        dtype: torch.dtype,
        device: torch.device,
        buffers: int,
        inflight: dict[int, InFlight],
    ) -> None:
        """``inflight``: the partition's reductions in flight (a full pool reclaims the oldest one's buffer)."""
        super().__init__(layout, params, dtype, device)
        self.shard = torch.zeros(layout.shard_numel, dtype=dtype, device=device)
        largest = max((b.numel for b in layout.buckets), default=0)
        self.pool = SendBuffers(largest, dtype, device, count=buffers)
        self.views: dict[tuple[int, int], list[torch.Tensor]] = {}  # (pooled buffer, bucket) -> its members' places
        self.inflight = inflight

    def send(self, bucket: LayoutBucket) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The bucket's send buffer with every gradient its members hold, which are then freed.

        [Note: packed at launch] Copying each gradient into the send buffer from its own hook
        cost ~5 µs of Python per parameter tensor (a third of a step at 10,000 tensors, 1.2× DDP).
        The bucket launches once all its gradients have arrived, so they are copied then, with one
        ``_foreach_copy_`` into views of the buffer made once per pooled buffer and bucket, and
        freed; a gradient of an earlier micro-step that the last one did not touch is among them.
        The bucket's gradients live until its launch, as in DDP's buckets: one bucket more at peak.
        """
        send, base = self.pool.acquire(bucket.numel, self.inflight)
        params = self.params
        grads = [params[i].grad for i in bucket.members]
        present = [k for k, g in enumerate(grads) if g is not None]  # gradients nobody produced stay zero
        if present:
            views = self._views(send, base, bucket)
            if len(present) < len(grads):
                views, grads = [views[k] for k in present], [grads[k] for k in present]
            torch._foreach_copy_(views, grads)
            for k in present:
                params[bucket.members[k]].grad = None
        return send, base

    def _views(self, send: torch.Tensor, base: torch.Tensor | None, bucket: LayoutBucket) -> list[torch.Tensor]:
        """Each member's place in ``send``, shaped like its parameter (cached per pooled buffer and bucket)."""
        key = (base.data_ptr(), bucket.index) if base is not None else None
        views = self.views.get(key) if key is not None else None
        if views is None:
            views = []
            for i in bucket.members:
                slot = self.layout.slots[i]
                assert slot is not None
                begin = slot.start - bucket.start
                views.append(send[begin : begin + slot.numel].view(self.params[i].shape))
            if key is not None:
                self.views[key] = views
        return views

    def chunk(self, bucket: LayoutBucket) -> torch.Tensor:
        return self.layout.shard_chunk(self.shard, bucket)

    def reductions_done(self) -> None:
        self.pool.release_all(self.inflight)

    def zero(self) -> None:
        self.shard.zero_()
        for b in self.layout.buckets:
            for i in b.members:
                self.params[i].grad = None

    def nbytes(self) -> int:
        return self.shard.numel() * self.shard.element_size()

    def buffer_bytes(self) -> int:
        return self.pool.total_bytes


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

    def acquire(self, numel: int, inflight: dict[int, InFlight]) -> tuple[torch.Tensor, torch.Tensor | None]:
        base = self.free.pop() if self.free else self._reclaim(inflight)
        if base is None:
            return torch.zeros(numel, dtype=self.dtype, device=self.device), None
        view = base[:numel]
        view.zero_()
        return view, base

    @staticmethod
    def _reclaim(inflight: dict[int, InFlight]) -> torch.Tensor | None:
        for index in sorted(inflight):
            flight = inflight[index]
            if flight.pooled is not None:
                flight.work.wait()
                base, flight.pooled = flight.pooled, None
                return base
        return None

    def release_all(self, inflight: dict[int, InFlight]) -> None:
        for flight in inflight.values():
            if flight.pooled is not None:
                self.free.append(flight.pooled)
                flight.pooled = None
