"""Which micro-batch a rank reads under a model-parallel mesh: its data-parallel coordinate.

[Note: shard by dp, never by world] Ranks that differ only in their pp, cp, sp or tp coordinate
work on one micro-batch together (Ulysses and context parallelism cut its sequences, tensor
parallelism its heads, the pipeline its layers), so they must all *read* that micro-batch. The
hosts shard by process count — Accelerate's ``BatchSamplerShard``, Lightning's
``DistributedSampler``, the Trainer's label count and its ``"auto"`` batch sizes — which under
``sequence_parallel_size: 2`` hands the two ranks of one sequence group different micro-batches.
The integrations shard by the dp coordinate instead, as the engine's own loader does
(``engine.training_dataloader``).

The host's loader is built before the engine, so the coordinate comes from the config: the mesh
is pure arithmetic over the config's parallel sections (``mesh_sizes``, the function the engine
itself factors the world with), so it is the one the engine's ``engine.mesh`` will have. Once an
engine exists, :func:`check_engine` confirms they agree.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import slipstream
from slipstream.errors import UsageError

# The config sections that size the mesh (engine/config/parallel.py); nothing else is parsed here, so
# "auto" values elsewhere (batch sizes, optimizer) are no obstacle before the host fills them.
_MESH_KEYS = (
    "tensor_parallel",
    "pipeline",
    "sequence_parallel_size",
    "context_parallel",
    "expert_parallel",
    "data_parallel_size",
)


@dataclasses.dataclass(frozen=True)
class DataParallelLayout:
    """The data-parallel view of one rank: ``size`` micro-batches are read at once, this rank reads number ``rank``.

    ``readers`` holds one rank per dp coordinate (the one whose other coordinates are all 0), in dp
    order: gathering from those ranks only sees every micro-batch once.
    """

    size: int
    rank: int
    world: int
    readers: tuple[int, ...]
    sequence_split: bool = False  # sp · cp > 1: the engine cuts each micro-batch's sequences across ranks

    @property
    def shared(self) -> bool:
        """True when several ranks read each micro-batch (some model-parallel axis is above 1)."""
        return self.size != self.world

    @property
    def sharers(self) -> int:
        """How many ranks read each micro-batch: ``world / dp``."""
        return self.world // self.size


def data_parallel_layout(config: dict[str, Any] | None, world_size: int, rank: int) -> DataParallelLayout:
    """This rank's dp coordinate and the dp size the engine will have, from the (host's) config dict."""
    from slipstream.engine.config import mesh_sizes
    from slipstream.engine.parallel.mesh import coordinates

    subset = {key: config[key] for key in _MESH_KEYS if isinstance(config, dict) and key in config}
    if not subset:
        return DataParallelLayout(size=world_size, rank=rank, world=world_size, readers=tuple(range(world_size)))
    sizes = mesh_sizes(slipstream.load_config(subset, world_size=None), world_size)
    coords = [coordinates(sizes, r) for r in range(world_size)]
    readers = sorted(
        (c["dp"], r) for r, c in enumerate(coords) if all(c[axis] == 0 for axis in ("pp", "cp", "sp", "tp"))
    )
    return DataParallelLayout(
        size=sizes.dp,
        rank=coords[rank]["dp"],
        world=world_size,
        readers=tuple(r for _, r in readers),
        sequence_split=sizes.sp * sizes.cp > 1,
    )


def check_engine(layout: DataParallelLayout, engine: Any) -> None:
    """The engine's mesh must give this rank the dp coordinate its data was sharded by."""
    mesh = getattr(engine, "mesh", None)
    if mesh is None:
        return
    if (mesh.size("dp"), mesh.rank_of("dp")) != (layout.size, layout.rank):
        raise UsageError(
            f"slipstream integrations: the data loader was sharded as dp rank {layout.rank} of {layout.size}, but the "
            f"engine's mesh puts this rank at dp {mesh.rank_of('dp')} of {mesh.size('dp')}; prepare the data loader "
            "with the same config as the model"
        )
