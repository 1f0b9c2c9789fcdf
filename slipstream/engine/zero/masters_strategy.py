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

from slipstream.engine.zero.masters import MasterWeights
from slipstream.engine.zero.sharding_groups import is_replica, sum_over_groups
from slipstream.engine.zero.slices import OwnedSlice, ParamSlice
from slipstream.engine.zero.strategy import ShardingOptions, ShardingStrategy


class MastersStrategy(ShardingStrategy):
    masters: MasterWeights
    options: ShardingOptions

    @abc.abstractmethod
    def _ranges(self) -> list[tuple[dist.ProcessGroup | None, int, int]]:
        """Each sharding group with the range ``[lo, hi)`` of this rank's partition sharded over it."""

    @abc.abstractmethod
    def _show_masters(self) -> None:
        """This rank's parameter chunks were just written from the masters: make every rank's parameters whole."""

    def global_grad_norm(self) -> torch.Tensor:
        partials = [(group, self.masters.grad_norm_squared(lo, hi)) for group, lo, hi in self._ranges()]
        return sum_over_groups(partials).sqrt()[0]

    def scale_gradients(self, factor: float) -> None:
        self.masters.scale_gradients(factor)

    def _owned_slices(self, pieces: list[tuple[ParamSlice, int, dist.ProcessGroup | None]]) -> list[OwnedSlice]:
        """One slice per ``(slice, partition offset, sharding group)``; replicas of another subgroup's are marked."""
        owned = self.masters.owned_slices([(piece, offset) for piece, offset, _ in pieces])
        return [
            dataclasses.replace(o, replicated=True) if is_replica(group, self.options.group) else o
            for o, (_, _, group) in zip(owned, pieces)
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
