"""A contiguous gradient buffer cut into buckets that all-reduce while backward runs.

[Note: buckets launch in index order] gloo and nccl match collectives by issue order, so every
rank must launch the same buckets in the same order even when gradients arrive in a different
order (data-dependent control flow, unused parameters). A bucket whose gradients are complete
waits until every lower-indexed bucket has launched; anything still pending is launched, in order,
by :meth:`BucketedAllReduce.finish`.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from slipstream import comm


def reduction_scales(world_size: int, predivide_factor: float, prescale: bool, average: bool) -> tuple[float, float]:
    """Factors applied before and after the sum, as DeepSpeed does it.

    By default gradients are divided by ``gradient_predivide_factor`` before the sum and by
    ``world_size / factor`` after; with ``prescale_gradients`` all of the division happens first.
    ``gradient_allreduce_op: "sum"`` skips the averaging.
    """
    if not average:
        return 1.0, 1.0
    if prescale:
        return 1.0 / world_size, 1.0
    return 1.0 / predivide_factor, predivide_factor / world_size


@dataclasses.dataclass
class Bucket:
    index: int
    start: int
    end: int
    members: list[int]  # parameter indices
    pending: int = 0
    work: comm.Work | None = None
    staging: torch.Tensor | None = None  # low-precision copy when communicating in another dtype

    @property
    def launched(self) -> bool:
        return self.work is not None


class BucketedAllReduce:
    """Owns the flat gradient buffer for ``params`` and averages it across the group in buckets.

    Parameters are laid out in reverse registration order, the order backward usually produces
    their gradients, so early buckets fill (and launch) first.
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        dtype: torch.dtype,
        bucket_numel: int,
        group: dist.ProcessGroup | None = None,
        communication_dtype: torch.dtype | None = None,
        predivide_factor: float = 1.0,
        prescale: bool = False,
        average: bool = True,
    ) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.communication_dtype = communication_dtype if communication_dtype not in (None, dtype) else None
        self.pre_scale, self.post_scale = reduction_scales(self.world_size, predivide_factor, prescale, average)
        total = sum(p.numel() for p in params)
        device = params[0].device if params else torch.device("cpu")
        self.buffer = torch.zeros(total, dtype=dtype, device=device)
        self.views: list[torch.Tensor] = [torch.empty(0)] * len(params)
        self.buckets: list[Bucket] = []
        self.bucket_of: list[int] = [0] * len(params)
        offset = 0
        current: Bucket | None = None
        for i in reversed(range(len(params))):
            n = params[i].numel()
            if current is None or (current.end - current.start + n > bucket_numel and current.members):
                current = Bucket(len(self.buckets), offset, offset, [])
                self.buckets.append(current)
            self.views[i] = self.buffer[offset : offset + n].view_as(params[i])
            current.members.append(i)
            current.end = offset + n
            self.bucket_of[i] = current.index
            offset += n
        self.ready = [False] * len(params)
        self._next_to_launch = 0
        self.reset()

    def reset(self) -> None:
        """Start a new reduction window (does not zero the buffer)."""
        for bucket in self.buckets:
            bucket.pending = len(bucket.members)
            bucket.work = None
            bucket.staging = None
        self.ready = [False] * len(self.ready)
        self._next_to_launch = 0

    def mark_ready(self, index: int, launch: bool) -> None:
        """Gradient ``index`` is final for this window; launch every bucket that can go."""
        if self.ready[index]:
            raise RuntimeError(
                f"gradient of parameter #{index} was produced twice in one backward pass; a parameter reached "
                "twice through reentrant backward (e.g. reentrant activation checkpointing) cannot be bucketed"
            )
        self.ready[index] = True
        bucket = self.buckets[self.bucket_of[index]]
        bucket.pending -= 1
        if launch:
            self._launch_in_order()

    def _launch_in_order(self, force: bool = False) -> None:
        while self._next_to_launch < len(self.buckets):
            bucket = self.buckets[self._next_to_launch]
            if bucket.pending and not force:
                return
            self._launch(bucket)
            self._next_to_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        flat = self.buffer[bucket.start : bucket.end]
        if self.pre_scale != 1.0:
            flat.mul_(self.pre_scale)
        if self.communication_dtype is not None:
            bucket.staging = flat.to(self.communication_dtype)
            flat = bucket.staging
        bucket.work = comm.all_reduce(flat, group=self.group, tag=f"gradient bucket {bucket.index}")

    def finish(self) -> None:
        """Launch what is left (in order) and wait for everything; the buffer then holds the mean."""
        self._launch_in_order(force=True)
        for bucket in self.buckets:
            bucket.work.wait()
            flat = self.buffer[bucket.start : bucket.end]
            if bucket.staging is not None:
                flat.copy_(bucket.staging)
            if self.post_scale != 1.0:
                flat.mul_(self.post_scale)
