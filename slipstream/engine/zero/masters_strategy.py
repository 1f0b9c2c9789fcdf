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
from slipstream.utils.pieces import ParamSlice
from slipstream.utils.placement import is_duplicate, placement_of

Piece = tuple[
    torch.Tensor, ParamSlice, int, "dist.ProcessGroup | None"
]  # (parameter, slice, partition offset, sharding group)


class MastersStrategy(ShardingStrategy):
    masters: MasterWeights
    options: ShardingOptions

    @abc.abstractmethod
    def _ranges(self) -> list[tuple[dist.ProcessGroup | None, int, int]]:
        """Each sharding group with the range ``[lo, hi)`` of this rank's partition sharded over it."""

    @abc.abstractmethod
    def _show_masters(self) -> None:
        """This rank's parameter chunks were just written from the masters: make every rank's parameters whole."""

    @abc.abstractmethod
    def _pieces(self) -> list[Piece]:
        """Every piece of this rank's partition (frozen parameters' too), in partition order."""

    def global_grad_norm(self) -> torch.Tensor:
        counted = self._counted_ranges()
        if counted is None:  # one sum per sharding group counts each element once
            partials = [(group, self.masters.grad_norm_squared(lo, hi)) for group, lo, hi in self._ranges()]
            return sum_over_groups(partials).sqrt()[0]
        total = torch.zeros(1, dtype=torch.float32, device=self.used.device)
        for lo, hi in counted:
            total += self.masters.grad_norm_squared(lo, hi)
        comm.all_reduce(total, tag="gradient norm").wait()  # [Note: the norm of a spread model]
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

    def scale_gradients(self, factor: float) -> None:
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
