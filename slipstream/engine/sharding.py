"""Step 4 of ``initialize``: the ZeRO strategy over what ``parallelize`` left on this rank.

The stage is chosen here, once; the Engine only makes the calls on ``ShardingStrategy``.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from slipstream.accelerator import Accelerator
from slipstream.comm.topology import INTRA, link_class, node_of
from slipstream.engine.config import ConfigError
from slipstream.engine.optimizers import build_optimizer
from slipstream.engine.options import EngineOptions
from slipstream.engine.parallel.mesh import DENSE, Mesh, partition
from slipstream.engine.zero.data_parallel import DataParallelStrategy
from slipstream.engine.zero.init import is_presharded, take_preshard
from slipstream.engine.zero.partitioned import PartitionedStrategy
from slipstream.engine.zero.single_rank import SingleRankStrategy
from slipstream.engine.zero.stage3.strategy import Hierarchy, Stage3Options, Stage3Strategy
from slipstream.engine.zero.stage3.units import find_units
from slipstream.engine.zero.strategy import ParamGroupSpec, ShardingStrategy
from slipstream.utils.logging import get_logger, log_rank0

logger = get_logger(__name__)

# The strategy currently attached to each model, so wrapping a model again detaches the old hooks.
# Weak both ways: a strategy refers to its model, so a strong value would keep both alive forever.
# While attached, a strategy is kept alive by its hooks on the model.
_attached: weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref[ShardingStrategy]] = weakref.WeakKeyDictionary()


def shard(
    model: torch.nn.Module, options: EngineOptions, mesh: Mesh, param_groups: Iterable[Any], accelerator: Accelerator
) -> ShardingStrategy:
    """The ZeRO strategy over the dense group (dp·cp·sp; experts over their own), with the optimizer it builds over its shards."""
    groups = ParamGroupSpec.from_user(param_groups)
    optimizer = options.optimizer
    if optimizer is None:
        optimizer_config = options.config.optimizer
        assert optimizer_config is not None

        def optimizer_factory(param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
            return build_optimizer(optimizer_config, param_groups, accelerator.supports_fused_adam())

        optimizer = optimizer_factory
    previous = _attached[model]() if model in _attached else None
    if previous is not None and previous.hooks:
        logger.warning("initialize: this model is still attached to an earlier engine; closing that engine's hooks")
        previous.close()
    # None is the default group: a dense group spanning the world is exactly that (no second group).
    sharding = dataclasses.replace(options.sharding, group=None if mesh.spans_world(*DENSE) else mesh.dense_group)
    strategy: ShardingStrategy
    if _single_rank(model, options, mesh):  # [Note: a world of one shards nothing]
        strategy = SingleRankStrategy(model, groups, sharding, optimizer, options.stage)
    elif options.stage == 0:
        strategy = DataParallelStrategy(model, groups, sharding, optimizer)
    elif options.stage3 is not None:
        strategy = Stage3Strategy(
            model,
            groups,
            sharding,
            optimizer,
            options.stage3,
            preshard=take_preshard(model),
            hierarchy=hierarchy(options.stage3, mesh),
        )
    else:
        strategy = PartitionedStrategy(model, groups, sharding, optimizer, stage=options.stage)
    _attached[model] = weakref.ref(strategy)
    return strategy


def _single_rank(model: torch.nn.Module, options: EngineOptions, mesh: Mesh) -> bool:
    """Whether this stage runs as the plain step of one process (zero/single_rank.py): a world of one, nothing
    offloaded, no zero.Init shards to start from, and not ``zero_optimization.partition_single_rank``. The stage's
    own config mistakes are refused here as at any world size, so a config that runs on one process runs on many."""
    if dist.get_world_size() != 1 or options.sharding.offload is not None or is_presharded(model):
        return False
    if options.config.zero_optimization.partition_single_rank:
        return False
    if options.stage3 is not None:
        find_units(model, options.stage3.unit_classes, options.stage3.persistence_threshold)
        hierarchy(options.stage3, mesh)
    if options.stage > 0:
        log_rank0(
            logger,
            f"ZeRO stage {options.stage} on one process: nothing to partition, so it runs as the plain step with the "
            "same memory (zero_optimization.partition_single_rank: true keeps the stage's partitioning)",
        )
    return True


def hierarchy(stage3: Stage3Options, mesh: Mesh) -> Hierarchy | None:
    """hpZ's secondary blocks or MiCS's shard groups, and qgZ's node blocks, cut from the dense group (collective:
    every rank makes every group).

    A size equal to the dense group is plain ZeRO-3 (one block holds everything); a size that
    does not divide it is refused naming the key. A block that spans nodes still works but
    gives up what the layout is for, so it is said once."""
    dense = len(mesh.ranks(*DENSE))
    kind, block, across = None, None, None
    layouts = (
        ("hpz", "zero_hpz_partition_size", stage3.hpz_size, 1),
        ("mics", "mics_shard_size", stage3.mics_shard_size, -1),
    )
    for name, key, size, off in layouts:
        if size == off:
            continue
        if dense % size:
            raise ConfigError(
                f"zero_optimization.{key}: {size} does not divide the data-parallel group of {dense} ranks (dp·cp·sp); "
                f"use a divisor of {dense}, usually the ranks per node"
            )
        if size < dense:
            kind, (block, across) = name, mesh.split(DENSE, size, name)
            if link_class(tuple(dist.get_process_group_ranks(block))) != INTRA:
                log_rank0(
                    logger,
                    "zero_optimization.%s: a block of %d ranks spans nodes (LOCAL_WORLD_SIZE); its gathers cross them",
                    key,
                    size,
                )
    nodes = None
    per_node = _dense_ranks_per_node(mesh) if stage3.gradient_bits else None
    if per_node is not None:  # qgZ: [Note: quantize only what crosses nodes] (comm/quantized.py)
        nodes = mesh.split(DENSE, per_node, "qgz")
    if kind is None and nodes is None:
        return None
    return Hierarchy(kind, block, across, nodes)


def _dense_ranks_per_node(mesh: Mesh) -> int | None:
    """How many ranks of each dense group share a node, when every dense group is the same number of
    consecutive ranks on each of several nodes; None when one node holds the group or the groups are ragged."""
    counts = set()
    for part in partition(mesh.sizes, DENSE):
        runs = [len(list(run)) for _, run in itertools.groupby(part, key=node_of)]
        if len(set(runs)) != 1 or len({node_of(rank) for rank in part}) != len(runs):
            return None
        counts.add(runs[0])
    count = counts.pop() if len(counts) == 1 else None
    return count if count is not None and count < len(mesh.ranks(*DENSE)) else None
