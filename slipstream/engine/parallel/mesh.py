"""The mesh: which ranks work together along each parallelism axis, built once at ``initialize``.

[Note: rank order] ``world = pp · dp · cp · sp · tp`` and a rank's coordinates are its digits in
that mixed radix, outer to inner: ``rank = (((pp_i·dp + dp_i)·cp + cp_i)·sp + sp_i)·tp + tp_i``.
tp is innermost so the chattiest axis (four all-reduces per block per micro-batch) stays on
neighbouring ranks, which are on one node (DeepSpeed, Megatron, picotron and torchtitan order it
so too). A group along an axis is the set of ranks that differ only in that coordinate.

[Note: expert groups] ``ep`` does not add ranks: it borrows them from ``dp · cp · sp · tp``
inside one pipeline stage. Its groups are *contiguous* blocks of ``ep`` ranks of the stage
(ranks ``k·ep … k·ep + ep − 1``), as in DeepSpeed and Megatron, so an expert all-to-all crosses
tp (innermost) first and stays on one node as long as ``ep`` fits there.

[Note: cheap groups] Every rank must create every process group, in the same order, even the
ones it is not in. With all axes but dp of size 1 (the common case) the mesh creates none: a
group that spans the world is the default group, and a group of one rank is a local group made
on first use (no other rank takes part). Groups are cached by their ranks, so several engines in
one process, and two axes with the same ranks (dp and dp·cp·sp when cp = sp = 1), share one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch.distributed as dist

from slipstream.comm.distributed import current_timeout
from slipstream.comm.topology import ranks_per_node
from slipstream.engine.config.parallel import ALL_AXES, AXES, MeshSizes
from slipstream.utils.eager_island import register
from slipstream.utils.logging import get_logger, log_rank0

logger = get_logger(__name__)

DENSE = ("dp", "cp", "sp")  # what dense parameters are sharded over (ZeRO): every copy of the same tp/pp shard
# Axis sets whose groups every mesh builds: each axis, the dense ZeRO group, and Ulysses × ring's sequence group.
BUILT = (*((axis,) for axis in ALL_AXES), DENSE, ("cp", "sp"))

_groups: dict[tuple[int, tuple[int, ...]], tuple[object, dist.ProcessGroup]] = {}
_labels: dict[
    tuple[int, ...], str
] = {}  # groups made outside the axes (pair_group, across): what to call their traffic


def canonical(axes: tuple[str, ...]) -> tuple[str, ...]:
    """``axes`` in mesh order (``("sp", "dp")`` and ``("dp", "sp")`` name the same group)."""
    unknown = [a for a in axes if a not in ALL_AXES]
    if unknown or not axes:
        raise ValueError(f"mesh: unknown axis {unknown or axes!r}; the axes are {', '.join(ALL_AXES)}")
    if "ep" in axes and len(axes) > 1:
        raise ValueError("mesh: ep borrows the ranks of dp·cp·sp·tp, so it combines with no other axis")
    return tuple(a for a in ALL_AXES if a in axes)


def coordinates(sizes: MeshSizes, rank: int) -> dict[str, int]:
    """``rank``'s coordinate on every axis (see [Note: rank order] and [Note: expert groups])."""
    coords: dict[str, int] = {}
    rest = rank
    for axis in reversed(AXES):
        coords[axis] = rest % sizes.size(axis)
        rest //= sizes.size(axis)
    coords["ep"] = rank % (sizes.world // sizes.pp) % sizes.ep
    return {axis: coords[axis] for axis in ALL_AXES}


def partition(sizes: MeshSizes, axes: tuple[str, ...]) -> list[tuple[int, ...]]:
    """Every group along ``axes``, each a sorted tuple of ranks, in one fixed order for all ranks."""
    axes = canonical(axes)
    if axes == ("ep",):
        return [tuple(range(start, start + sizes.ep)) for start in range(0, sizes.world, sizes.ep)]
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(sizes.world):
        coords = coordinates(sizes, rank)
        groups.setdefault(tuple(coords[a] for a in AXES if a not in axes), []).append(rank)
    return [tuple(ranks) for ranks in groups.values()]


def _shared_group(ranks: tuple[int, ...]) -> dist.ProcessGroup:
    """The process group of ``ranks`` (collective: every rank asks for the same groups in the same order)."""
    world = dist.group.WORLD
    key = (id(world), ranks)
    hit = _groups.get(key)
    if hit is not None and hit[0] is world:
        return hit[1]
    group = dist.new_group(list(ranks), timeout=current_timeout())
    _groups[key] = (world, group)
    register(group)  # usable inside compiled blocks (utils/eager_island.py)
    return group


def _own_group() -> dist.ProcessGroup:
    """A group of this rank alone, made locally (no other rank takes part) once per default group."""
    rank = dist.get_rank()
    key = (id(dist.group.WORLD), (-1, rank))
    hit = _groups.get(key)
    if hit is not None and hit[0] is dist.group.WORLD:
        return hit[1]
    group = dist.new_group([rank], timeout=current_timeout(), use_local_synchronization=True)
    _groups[key] = (dist.group.WORLD, group)
    register(group)
    return group


@dataclasses.dataclass(frozen=True)
class Mesh:
    """The frozen mesh: sizes, this rank's coordinates, and a process group per axis.

    ``size(axis)``, ``rank_of(axis)`` and ``group(*axes)`` for axis in pp, dp, cp, sp, tp, ep;
    ``group("dp", "cp", "sp")`` (also :attr:`dense_group`) is the group ZeRO shards dense
    parameters over. Build it with :meth:`build` (collective).
    """

    sizes: MeshSizes
    rank: int
    coords: Mapping[str, int]
    _ranks: Mapping[tuple[str, ...], tuple[int, ...]]  # this rank's group along each built axis set
    _groups: Mapping[tuple[str, ...], dist.ProcessGroup | None]  # None: a group of one, made on first use

    @classmethod
    def build(cls, sizes: MeshSizes, log: bool = True) -> Mesh:
        """Create the groups of every axis on every rank, in the same order; log the layout on rank 0."""
        world, rank = dist.get_world_size(), dist.get_rank()
        if sizes.world != world:
            raise ValueError(f"mesh: {sizes.describe()} does not match the process group's world size {world}")
        ranks: dict[tuple[str, ...], tuple[int, ...]] = {}
        groups: dict[tuple[str, ...], dist.ProcessGroup | None] = {}
        for axes in BUILT:
            parts = partition(sizes, axes)
            mine = next(part for part in parts if rank in part)
            ranks[axes] = mine
            if len(mine) == world:
                groups[axes] = dist.group.WORLD
            elif len(mine) == 1:
                groups[axes] = None
            else:
                for part in parts:  # every rank creates every group, members or not
                    group = _shared_group(part)
                    if part is mine:
                        groups[axes] = group
        mesh = cls(sizes, rank, coordinates(sizes, rank), ranks, groups)
        register(dist.group.WORLD)  # an axis spanning the world uses it (utils/eager_island.py)
        if log:
            log_rank0(logger, "%s", mesh.describe())
            logger.debug("mesh: rank %d at %s", rank, mesh.describe_coordinates())
        return mesh

    def size(self, axis: str) -> int:
        """How many ranks the axis spans."""
        return self.sizes.size(axis)

    def rank_of(self, axis: str) -> int:
        """This rank's coordinate on ``axis`` (its rank within ``group(axis)``)."""
        return self.coords[canonical((axis,))[0]]

    def ranks(self, *axes: str) -> tuple[int, ...]:
        """The global ranks of this rank's group along ``axes``."""
        return self._ranks[self._built(axes)]

    def group(self, *axes: str) -> dist.ProcessGroup:
        """This rank's process group along ``axes`` (the default group when it spans the world)."""
        group = self._groups[self._built(axes)]
        return group if group is not None else _own_group()

    def pair_group(self, axis: str, coordinates: tuple[int, ...]) -> dist.ProcessGroup | None:
        """The ranks of this rank's ``axis`` group at ``coordinates`` on it (e.g. a pipeline's first and last
        stage), as a process group; None when this rank is at none of them. Collective: every rank creates
        every such group (one per ``axis`` group), in the same order."""
        mine = None
        for part in partition(self.sizes, (axis,)):  # a part's i-th rank is at coordinate i on the axis
            ranks = tuple(part[c] for c in coordinates)
            group = _shared_group(ranks)
            _labels.setdefault(ranks, f"{axis}-pairs")
            if self.rank in ranks:
                mine = group
        return mine

    def across(self, axis: str) -> dist.ProcessGroup:
        """The ranks of this pipeline stage at this rank's coordinate on ``axis``, one from each of the stage's
        groups along it (for ep: the ranks that hold the same experts, over which ZeRO shards them; ranks of
        other stages hold other layers). Collective: every rank creates every such group, in the same order."""
        by_stage: dict[int, list[tuple[int, ...]]] = {}
        for part in partition(self.sizes, (axis,)):
            by_stage.setdefault(coordinates(self.sizes, part[0])["pp"], []).append(part)
        mine = None
        for parts in by_stage.values():
            for position in range(len(parts[0])):
                ranks = tuple(part[position] for part in parts)
                group = _shared_group(ranks)
                _labels.setdefault(ranks, f"across-{axis}")
                if self.rank in ranks:
                    mine = group
        assert mine is not None
        return mine

    def split(self, axes: tuple[str, ...], size: int, label: str) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
        """This rank's block of ``size`` consecutive ranks of its group along ``axes``, and the ranks at its position
        in the other blocks of that group (None when one block is the whole group).

        The blocks are what hpZ's secondary partition and MiCS's shards use: consecutive ranks, so
        on one node while ``size`` ranks (times the inner axes) fit there ([Note: nodes from the
        launch] in comm/topology.py). Collective: every rank creates every such group, in the same order.
        """
        mine: tuple[dist.ProcessGroup | None, dist.ProcessGroup | None] = (None, None)
        for part in partition(self.sizes, axes):
            if len(part) % size:
                raise ValueError(
                    f"mesh: {label} size {size} does not divide the {'·'.join(axes)} group of {len(part)} ranks"
                )
            blocks = [part[i : i + size] for i in range(0, len(part), size)]
            for block in blocks:
                group = _shared_group(block) if len(block) > 1 else None
                _labels.setdefault(block, f"{label}-block")
                if self.rank in block:
                    mine = (group if group is not None else _own_group(), mine[1])
            if len(blocks) > 1:
                for position in range(size):
                    ranks = tuple(block[position] for block in blocks)
                    group = _shared_group(ranks)
                    _labels.setdefault(ranks, f"{label}-across")
                    if self.rank in ranks:
                        mine = (mine[0], group)
        assert mine[0] is not None
        return mine[0], mine[1]

    @property
    def dense_group(self) -> dist.ProcessGroup:
        """dp·cp·sp: the ranks holding the same dense (tp/pp) shard, over which ZeRO partitions it."""
        return self.group(*DENSE)

    def spans_world(self, *axes: str) -> bool:
        return len(self.ranks(*axes)) == self.sizes.world

    def _built(self, axes: tuple[str, ...]) -> tuple[str, ...]:
        key = canonical(axes)
        if key not in self._ranks:
            built = ", ".join("·".join(k) for k in self._ranks)
            raise ValueError(f"mesh: no group for {'·'.join(key)}; the mesh builds {built}")
        return key

    def traffic(self, records: Iterable[Any]) -> dict[str, int]:
        """Bytes this rank moved per axis (``comms_log`` records: ``.ranks`` of their group, ``.moved``): "tp",
        "dp-cp-sp", "across-ep" (the expert-data group), "pp-pairs", "world" (the default group). Axes whose
        groups have the same ranks share one process group, so their traffic shares a name ("tp+ep" when
        expert parallel folds onto the tensor-parallel ranks)."""
        singles: dict[tuple[int, ...], list[str]] = {}
        names: dict[tuple[int, ...], str] = {}
        for axes, ranks in self._ranks.items():
            if len(ranks) > 1:
                if len(axes) == 1:
                    singles.setdefault(ranks, []).append(axes[0])
                names.setdefault(ranks, "-".join(axes))
        names.update({ranks: "+".join(axes) for ranks, axes in singles.items()})
        world = names.get(tuple(range(self.sizes.world)), "world")  # an axis spanning the world uses the default group
        totals: dict[str, int] = {}
        for record in records:
            ranks = record.ranks
            label = (
                world
                if ranks is None
                else names.get(ranks) or _labels.get(ranks) or ("local" if len(ranks) == 1 else "other")
            )
            totals[label] = totals.get(label, 0) + record.moved
        return totals

    def describe_coordinates(self) -> str:
        return ", ".join(f"{axis} {self.coords[axis]}" for axis in ALL_AXES)

    def describe(self) -> str:
        """Sizes, rank 0's coordinates and every group of each axis longer than one rank."""
        lines = [f"mesh: {self.sizes.describe()}; rank {self.rank} at {self.describe_coordinates()}"]
        per_node = ranks_per_node()
        if per_node < self.sizes.world:  # [Note: nodes from the launch] in comm/topology.py
            lines.append(f"  nodes: {self.sizes.world // per_node} × {per_node} ranks (LOCAL_WORLD_SIZE)")
        for axes in BUILT:
            if 1 < len(self._ranks[axes]):
                parts = partition(self.sizes, axes)
                lines.append(f"  {'·'.join(axes)} groups: {' '.join(str(list(p)) for p in parts)}")
        return "\n".join(lines)
