"""A contiguous gradient buffer cut into buckets that all-reduce while backward runs.

Buckets launch in index order on every rank (see ``ordered_launch``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist

from slipstream import comm
from slipstream.comm.context import CommContext, Pending
from slipstream.engine.zero.ordered_launch import OrderedLauncher


def reduction_scales(world_size: int, predivide_factor: float, prescale: bool, average: bool) -> tuple[float, float]:
    """Factors applied before and after the sum.

    With a ``gradient_predivide_factor`` f, gradients are divided by f before the sum and by
    ``world_size / f`` after, as DeepSpeed does; without one (or with ``prescale_gradients``) the
    whole division happens before the sum, so nothing is left to do afterwards (for 2^k ranks
    this is bit-identical to dividing afterwards). ``gradient_allreduce_op: "sum"`` skips it.
    """
    if not average:
        return 1.0, 1.0
    if prescale or predivide_factor == 1.0:
        return 1.0 / world_size, 1.0
    return 1.0 / predivide_factor, predivide_factor / world_size


@dataclasses.dataclass
class Bucket:
    index: int
    start: int
    end: int
    members: list[int]  # parameter indices
    group: dist.ProcessGroup | None = None  # averaged over this group (its parameter group's sharding group)
    work: comm.Work | Pending | None = None
    staging: torch.Tensor | None = None  # low-precision copy when communicating in another dtype


class BucketedAllReduce:
    """Owns the flat gradient buffer for ``params`` and averages it across the group in buckets.

    Parameters are laid out in reverse registration order, the order backward usually produces
    their gradients, so early buckets fill (and launch) first. ``groups[i]`` (default: ``group`` for
    all) is the process group parameter ``i`` is averaged over; a bucket never mixes groups.
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
        groups: list[dist.ProcessGroup | None] | None = None,
        context: CommContext | None = None,
        tail: int = 0,
    ) -> None:
        self.group = group
        self.context = context if context is not None else CommContext()  # the strategy's: all-reduces on their stream
        self.communication_dtype = communication_dtype if communication_dtype not in (None, dtype) else None
        self.scales = lambda g: reduction_scales(dist.get_world_size(g), predivide_factor, prescale, average)
        groups = groups if groups is not None else [group] * len(params)
        total = sum(p.numel() for p in params)
        device = params[0].device if params else torch.device("cpu")
        # [Note: a tail on the last bucket] ``tail`` extra elements after the gradients ride the last bucket's
        # all-reduce (it launches when every gradient of the window has arrived, so whatever the owner writes there
        # just before, through ``fill_tail``, is final): the used-parameter flags, one collective fewer per step.
        # Only where every bucket shares one group; ``self.tail`` is None otherwise and the owner reduces its own.
        carried = tail if params and len({id(g) for g in groups}) == 1 else 0
        self._storage = torch.zeros(total + carried, dtype=dtype, device=device)
        self.buffer = self._storage[:total]  # the gradients alone (norms, scaling, zeroing read this)
        self.tail: torch.Tensor | None = self._storage[total:] if carried else None
        self.fill_tail: Callable[[torch.Tensor], None] | None = None
        self.views: list[torch.Tensor] = [torch.empty(0)] * len(params)
        self.buckets: list[Bucket] = []
        offset = 0
        current: Bucket | None = None
        for i in reversed(range(len(params))):
            n = params[i].numel()
            full = current is not None and current.end - current.start + n > bucket_numel and current.members
            if current is None or full or groups[i] is not current.group:
                current = Bucket(len(self.buckets), offset, offset, [], groups[i])
                self.buckets.append(current)
            self.views[i] = self.buffer[offset : offset + n].view_as(params[i])
            current.members.append(i)
            current.end = offset + n
            offset += n
        self.launcher = OrderedLauncher([b.members for b in self.buckets], self._launch)

    def reset(self) -> None:
        """Start a new reduction window (does not zero the buffer)."""
        for bucket in self.buckets:
            bucket.work = None
            bucket.staging = None
        self.launcher.reset()

    def _flat(self, bucket: Bucket) -> torch.Tensor:
        """What the bucket all-reduces: its gradients, and the tail after the last bucket's."""
        last = self.tail is not None and bucket.index == len(self.buckets) - 1
        return self._storage[bucket.start : bucket.end + (self.tail.numel() if last else 0)]  # type: ignore[union-attr]

    def _launch(self, index: int, waited: bool = False) -> None:
        bucket = self.buckets[index]
        if self.tail is not None and index == len(self.buckets) - 1:
            assert self.fill_tail is not None, "a reducer with a tail needs fill_tail"
            self.fill_tail(self.tail)
        flat = self._flat(bucket)
        pre_scale, _ = self.scales(bucket.group)
        if pre_scale != 1.0:
            flat.mul_(pre_scale)
        if self.communication_dtype is not None:
            bucket.staging = flat.to(self.communication_dtype)
            flat = bucket.staging
        tag = f"gradient bucket {bucket.index}"
        bucket.work = self.context.issue(
            "all_reduce", lambda: comm.all_reduce(flat, group=bucket.group, tag=tag, inline=waited), tag
        )

    def finish(self) -> None:
        """Launch what is left (in order) and wait for everything.

        The buffer then holds the averaged gradients.
        """
        self.launcher.flush()
        for bucket in self.buckets:
            bucket.work.wait()
            flat = self._flat(bucket)
            if bucket.staging is not None:
                flat.copy_(bucket.staging)
            _, post_scale = self.scales(bucket.group)
            if post_scale != 1.0:
                flat.mul_(post_scale)
