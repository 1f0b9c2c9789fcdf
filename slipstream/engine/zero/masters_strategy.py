"""What ZeRO stages 1, 2 and 3 answer alike: every call that concerns the optimizer, the gradient norm
or the checkpoint slices goes through their one :class:`MasterWeights`.

A subclass says how its sharding groups map onto this rank's partition (``_ranges``) and how
updated masters reach every rank's parameters (``_show_masters``: an all-gather per bucket at
stages 1/2, the persistent units' refresh at stage 3).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from slipstream import comm
from slipstream.engine.zero.masters import MasterWeights
from slipstream.engine.zero.sharding_groups import is_replica, model_spread, sum_over_groups
from slipstream.engine.zero.slices import OwnedSlice
from slipstream.engine.zero.strategy import ShardingOptions, ShardingStrategy
from slipstream.engine.zero.used_flags import UsedFlags
from slipstream.utils.pieces import ParamSlice
from slipstream.utils.placement import is_duplicate, placement_of

Piece = tuple[
    torch.Tensor, ParamSlice, int, "dist.ProcessGroup | None"
]  # (parameter, slice, partition offset, sharding group)


class MastersStrategy(ShardingStrategy):
    masters: MasterWeights
    options: ShardingOptions
    used: UsedFlags
    _norm: torch.Tensor | None = None  # this boundary's norm, when it rode with the flags

    @abc.abstractmethod
    def _ranges(self) -> list[tuple[dist.ProcessGroup | None, int, int]]:
        """Each sharding group with the range ``[lo, hi)`` of this rank's partition sharded over it."""

    @abc.abstractmethod
    def _show_masters(self) -> None:
        """This rank's parameter chunks were just written from the masters: make every rank's parameters whole."""

    @abc.abstractmethod
    def _pieces(self) -> list[Piece]:
        """Every piece of this rank's partition (frozen parameters' too), in partition order."""

    def _gradients_final(self, members: list[tuple[dist.ProcessGroup | None, list[int]]]) -> None:
        """The window's gradients are reduced: agree on the used flags over ``members`` and hand them to the masters.

        [Note: the flags ride the norm] Every boundary needs both the used flags (which parameters got a
        gradient on any rank) and the gradient norm (the overflow check and the clipping), each an
        all-reduce over the sharding group. Where the flags and the norm share that one group (no MiCS,
        no tp/pp/ep spread, one parameter group), this rank's squared norm rides in the flags' tensor:
        one all-reduce instead of two. The flags are summed rather than maxed (a count above zero is a
        use), and the norm is the sum over the same group of the same partial :meth:`global_grad_norm`
        makes. The norm is kept for that boundary's ``global_grad_norm``.
        """
        self.masters.prepare_gradients()  # the fp32 copies the norm reads
        ranges = self._ranges()
        one_group = len(members) == 1 and len(ranges) == 1 and members[0][0] is ranges[0][0]
        if one_group and self._counted_ranges() is None:
            group, lo, hi = ranges[0]
            fused = torch.empty(1 + len(self.used.local), dtype=torch.float32, device=self.used.device)
            fused[:1] = self.masters.grad_norm_squared(lo, hi)
            self.used.write(fused[1:])
            comm.all_reduce(fused, group=group, tag="used-parameter flags and gradient norm", inline=True).wait()
            self._norm = fused[:1].sqrt()[0]
            used = self.used.read(fused[1:])
        else:
            self._norm = None
            used = self.used.reduce(members)
        self.masters.use_gradients(used)

    def global_grad_norm(self) -> torch.Tensor:
        norm, self._norm = self._norm, None
        if norm is not None:  # [Note: the flags ride the norm]
            return norm
        counted = self._counted_ranges()
        if counted is None:  # one sum per sharding group counts each element once
            partials = [(group, self.masters.grad_norm_squared(lo, hi)) for group, lo, hi in self._ranges()]
            return sum_over_groups(partials).sqrt()[0]
        total = torch.zeros(1, dtype=torch.float32, device=self.used.device)
        for lo, hi in counted:
            total += self.masters.grad_norm_squared(lo, hi)
        comm.all_reduce(total, tag="gradient norm", inline=True).wait()  # [Note: the norm of a spread model]
        return total.sqrt()[0]

    def _counted_ranges(self) -> list[tuple[int, int]] | None:
        """For a spread model, the partition ranges this rank counts in the norm (merged); else None."""
        if not hasattr(self, "_counted"):
            pieces = self._pieces()
            self._counted: list[tuple[int, int]] | None = None
            if model_spread([p for p, *_ in pieces], self.options.group):
                ranges: list[tuple[int, int]] = []
                for param, where, offset, group in pieces:
                    if self._duplicate(param, group):
                        continue
                    if ranges and ranges[-1][1] == offset:
                        ranges[-1] = (ranges[-1][0], offset + where.numel)
                    else:
                        ranges.append((offset, offset + where.numel))
                self._counted = ranges
        return self._counted

    def _duplicate(self, param: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
        """Saved elsewhere: a piece its placement marks duplicate, or (unplaced) another subgroup's replica."""
        if placement_of(param) is not None:
            return is_duplicate(param)
        return is_replica(group, self.options.group)

    def scale_gradients(self, factor: float | torch.Tensor) -> None:
        self.masters.scale_gradients(factor)

    def _owned_slices(self) -> list[OwnedSlice]:
        """One slice per piece; what another rank saves (see ``_duplicate``) is marked."""
        pieces = self._pieces()
        owned = self.masters.owned_slices([(where, offset) for _, where, offset, _ in pieces])
        return [
            dataclasses.replace(o, duplicate=True) if self._duplicate(param, group) else o
            for o, (param, _, _, group) in zip(owned, pieces)
        ]

    def slice_optimizer_state(self, owned: OwnedSlice) -> dict[str, Any] | None:
        return self.masters.slice_optimizer_state(owned)

    def load_slice_optimizer_state(self, owned: OwnedSlice, state: dict[str, Any] | None) -> None:
        self.masters.load_slice_optimizer_state(owned, state)

    def load_sharded_state(self, read: Callable[[ParamSlice], torch.Tensor]) -> None:
        self.masters.load(self.sharded_state(), read)
        with torch.no_grad():
            self.masters.publish()  # into this rank's parameter chunks (device, CPU or NVMe)
        self._show_masters()

    def close(self) -> None:
        super().close()
        self.masters.close()
