"""``GatheredParameters``: the full values of ZeRO-3 partitioned parameters inside a ``with`` block.

[Note: no global registry of units] A partitioned parameter finds its engine through a mapping
that holds only weak references (to the parameter and to the engine's :class:`PartitionedUnits`).
Nothing here keeps an engine or a model alive: once an engine is discarded, its parameters simply
stop being found, and an entry goes with its parameter. (Keyed by ``id``: a ``WeakKeyDictionary``
would compare parameters with ``==``, which is elementwise for tensors.)
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from slipstream import comm
from slipstream.engine.zero.stage3.unit import ParamUnit

_owner: dict[int, tuple[weakref.ref[torch.nn.Parameter], weakref.ref[PartitionedUnits]]] = {}


def _owner_of(p: torch.Tensor) -> PartitionedUnits | None:
    entry = _owner.get(id(p))
    if entry is None or entry[0]() is not p:
        return None
    return entry[1]()


@dataclasses.dataclass(eq=False)
class PartitionedUnits:
    """What ``GatheredParameters`` needs of one engine: each parameter's unit, where shards and masters live."""

    units: list[ParamUnit]
    store: Any  # ParamStore (offload/param_store.py): the shards, on the device, in CPU memory or on NVMe
    masters: Any  # MasterWeights (masters.py)

    def register(self) -> None:
        for unit in self.units:
            for p in unit.params:
                _owner[id(p)] = (weakref.ref(p, lambda _, key=id(p): _owner.pop(key, None)), weakref.ref(self))  # noqa: B008 (binds the id now)

    def unregister(self) -> None:
        for unit in self.units:
            for p in unit.params:
                _owner.pop(id(p), None)

    def gather(self, units: list[ParamUnit]) -> None:
        for unit in sorted(units, key=lambda u: u.index):
            unit.unshard(exact=True)  # the weights themselves, never qwZ's INT8 approximation
        for unit in units:
            unit.wait()

    def repartition(self, units: list[ParamUnit], modifier_rank: int | None) -> None:
        """After the block: adopt ``modifier_rank``'s values (shards and fp32 masters), then free."""
        for unit in sorted(units, key=lambda u: u.index):
            if modifier_rank is not None:
                group = unit.lanes.data  # MiCS: every shard group adopts the modifier's values
                src = dist.get_global_rank(group, modifier_rank) if group is not None else modifier_rank
                comm.broadcast(unit.flat, src=src, group=group, tag=f"GatheredParameters unit {unit.index}").wait()
                own = unit.own_chunk()
                self.store.modified(unit, own)
                self.masters.write(unit.offset, own.float())
            unit.reshard()
            unit.shard_changed()


class GatheredParameters:
    """Context manager: the full values of ZeRO-3 partitioned ``params`` inside the block.

    With ``modifier_rank`` set, changes that rank makes in place (under ``torch.no_grad()``) are
    broadcast and re-partitioned on exit, fp32 master weights included. Collective: every rank
    enters with the same parameters. Parameters that are not partitioned pass through untouched.
    """

    def __init__(
        self,
        params: torch.nn.Parameter | Iterable[torch.nn.Parameter],
        modifier_rank: int | None = None,
        enabled: bool = True,
    ) -> None:
        self.params = [params] if isinstance(params, torch.Tensor) else list(params)
        self.modifier_rank, self.enabled = modifier_rank, enabled
        self._by_owner: dict[int, tuple[PartitionedUnits, list[ParamUnit]]] = {}

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        for p in self.params:
            owner = _owner_of(p)
            if owner is None:
                continue
            unit = next(u for u in owner.units if any(q is p for q in u.params))
            units = self._by_owner.setdefault(id(owner), (owner, []))[1]
            if unit not in units:
                units.append(unit)
        for owner, units in self._by_owner.values():
            owner.gather(units)
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, units in self._by_owner.values():
            owner.repartition(units, self.modifier_rank if exc[0] is None else None)
        self._by_owner.clear()
