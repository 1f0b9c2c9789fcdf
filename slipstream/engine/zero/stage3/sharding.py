"""ZeRO-3 set-up: units cut by sharding group, each group's units laid out over its ranks, this rank's shard.

A unit whose parameters belong to parameter groups sharded over different process groups becomes
one unit per group (same module, gathered by the same hooks). Each group's units form one
:class:`FlatLayout` (one bucket per unit) over that group's ranks; this rank's chunks of all
groups, concatenated, are its partition (``partition.py``), held in one flat ``shard``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist

from slipstream.engine.config.base import ConfigError
from slipstream.engine.zero.flat_layout import FlatLayout
from slipstream.engine.zero.stage3.unit import GroupLanes, ParamUnit
from slipstream.engine.zero.stage3.units import UnitSpec
from slipstream.engine.zero.storage import copy_pieces

Preshard = Callable[[FlatLayout], torch.Tensor]


@dataclasses.dataclass
class GroupLayout:
    """One sharding group's units: its lanes, its layout and where its chunks start in the partition."""

    lanes: GroupLanes
    layout: FlatLayout
    base: int


@dataclasses.dataclass
class ShardedUnits:
    units: list[ParamUnit]
    groups: list[GroupLayout]
    managed: list[torch.nn.Parameter]  # every partitioned parameter; layout indices point here
    shard: torch.Tensor  # this rank's partition of the parameters (model dtype)


def split_units(
    specs: list[UnitSpec], group_of: Callable[[torch.nn.Parameter], dist.ProcessGroup | None]
) -> list[tuple[dist.ProcessGroup | None, UnitSpec]]:
    """Each unit cut into one unit per sharding group of its parameters, renumbered in order."""
    out: list[tuple[dist.ProcessGroup | None, UnitSpec]] = []
    for spec in specs:
        by_group: dict[int, tuple[dist.ProcessGroup | None, list[torch.nn.Parameter]]] = {}
        for p in spec.params:
            group = group_of(p)
            by_group.setdefault(id(group), (group, []))[1].append(p)
        for group, params in by_group.values():
            out.append((group, UnitSpec(len(out), spec.kind, spec.module, spec.name, params)))
    return out


def shard_units(
    specs: list[tuple[dist.ProcessGroup | None, UnitSpec]],
    dtype: torch.dtype,
    device: torch.device,
    preshard: Preshard | None,
    lanes_of: Callable[[dist.ProcessGroup | None], GroupLanes] = GroupLanes.of,
) -> ShardedUnits:
    """Lay out and partition the units; ``preshard`` (zero.Init) gives this rank's shard instead of the full weights;
    ``lanes_of``: a group's lanes (hpZ's and MiCS's extra groups)."""
    managed = [p for _, spec in specs for p in spec.params]
    position = {id(p): i for i, p in enumerate(managed)}
    by_group: dict[int, tuple[dist.ProcessGroup | None, list[UnitSpec]]] = {}
    for group, spec in specs:  # first-use order: the same on every rank
        by_group.setdefault(id(group), (group, []))[1].append(spec)
    groups, base = [], 0
    for group, members in by_group.values():
        lanes = lanes_of(group)
        layout = FlatLayout(
            [p.numel() for p in managed],
            [],
            0,
            lanes.world,
            lanes.rank,
            buckets=[[position[id(p)] for p in spec.params] for spec in members],
        )
        groups.append(GroupLayout(lanes, layout, base))
        base += layout.shard_numel
    if preshard is not None:
        if len(groups) != 1:
            raise ConfigError(
                "zero_optimization: a model built under zero.Init cannot have parameter groups sharded over different "
                "process groups yet; build it without zero.Init or shard every group over the same process group"
            )
        shard = preshard(groups[0].layout).to(device=device, dtype=dtype)
    else:
        shard = torch.zeros(base, dtype=dtype, device=device)
        with torch.no_grad():
            for g in groups:
                for piece in g.layout.pieces:
                    copy_pieces(managed[piece.index].detach(), shard[g.base :], [piece])
    units = []
    for g in groups:
        members = {id(spec) for spec in by_group[id(g.lanes.group)][1]}
        unit_specs = [spec for _, spec in specs if id(spec) in members]
        for spec, bucket in zip(unit_specs, g.layout.buckets):
            chunk = shard[g.base + bucket.shard_offset : g.base + bucket.shard_offset + bucket.chunk]
            units.append(ParamUnit(spec, bucket, g.layout, chunk, g.lanes, g.base))
    units.sort(key=lambda u: u.index)
    return ShardedUnits(units, groups, managed, shard)
