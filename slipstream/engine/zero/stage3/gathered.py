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
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from slipstream import comm
from slipstream.engine.zero.stage3.unit import ParamUnit

_owner: dict[int, tuple[weakref.ref[torch.nn.Parameter], weakref.ref[Owner]]] = {}


def _owner_of(p: torch.Tensor) -> Owner | None:
    entry = _owner.get(id(p))
    if entry is None or entry[0]() is not p:
        return None
    return entry[1]()


class Owner:
    """An engine's answer to ``GatheredParameters`` for the parameters it registered: what to gather (an
    item: a unit, or a parameter's index), and what to adopt from ``modifier_rank`` after the block."""

    def params(self) -> list[torch.nn.Parameter]:
        raise NotImplementedError

    def item_of(self, p: torch.nn.Parameter) -> Any:
        raise NotImplementedError

    def gather(self, items: list[Any]) -> None:
        raise NotImplementedError

    def repartition(self, items: list[Any], modifier_rank: int | None) -> None:
        raise NotImplementedError

    def register(self) -> None:
        for p in self.params():
            _owner[id(p)] = (weakref.ref(p, lambda _, key=id(p): _owner.pop(key, None)), weakref.ref(self))  # noqa: B008 (binds the id now)

    def unregister(self) -> None:
        for p in self.params():
            _owner.pop(id(p), None)


@dataclasses.dataclass(eq=False)
class PartitionedUnits(Owner):
    """What ``GatheredParameters`` needs of one ZeRO-3 engine: each parameter's unit, where shards and masters live."""

    units: list[ParamUnit]
    store: Any  # ParamStore (offload/param_store.py): the shards, on the device, in CPU memory or on NVMe
    masters: Any  # MasterWeights (masters.py)

    def params(self) -> list[torch.nn.Parameter]:
        return [p for unit in self.units for p in unit.params]

    def item_of(self, p: torch.nn.Parameter) -> ParamUnit:
        return next(u for u in self.units if any(q is p for q in u.params))

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


@dataclasses.dataclass(eq=False)
class MasterCopies(Owner):
    """Whole low-precision parameters with fp32 masters on one process (single_rank.py): nothing to gather; a
    change made in the block reaches the masters, as it reaches ZeRO-3's, so the next step keeps it."""

    trainable: list[torch.nn.Parameter]
    adopt: Callable[[list[int]], None]  # the masters of these trainable indices take their parameters' values

    def params(self) -> list[torch.nn.Parameter]:
        return self.trainable

    def item_of(self, p: torch.nn.Parameter) -> int:
        return next(i for i, q in enumerate(self.trainable) if q is p)

    def gather(self, items: list[int]) -> None:
        pass

    def repartition(self, items: list[int], modifier_rank: int | None) -> None:
        if modifier_rank is not None:
            self.adopt(items)


class GatheredParameters:
    """Context manager: the full values of ZeRO-3 partitioned ``params`` inside the block.

    With ``modifier_rank`` set, changes that rank makes in place (under ``torch.no_grad()``) are
    broadcast and re-partitioned on exit, fp32 master weights included. Collective: every rank
    enters with the same parameters. Parameters that are not partitioned pass through untouched, except
    that on one process a change to low-precision parameters reaches their fp32 masters too (single_rank.py).
    """

    def __init__(
        self,
        params: torch.nn.Parameter | Iterable[torch.nn.Parameter],
        modifier_rank: int | None = None,
        enabled: bool = True,
    ) -> None:
        self.params = [params] if isinstance(params, torch.Tensor) else list(params)
        self.modifier_rank, self.enabled = modifier_rank, enabled
        self._by_owner: dict[int, tuple[Owner, list[Any]]] = {}

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        for p in self.params:
            owner = _owner_of(p)
            if owner is None:
                continue
            item = owner.item_of(p)
            items = self._by_owner.setdefault(id(owner), (owner, []))[1]
            if item not in items:
                items.append(item)
        for owner, units in self._by_owner.values():
            owner.gather(units)
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, units in self._by_owner.values():
            owner.repartition(units, self.modifier_rank if exc[0] is None else None)
        self._by_owner.clear()
