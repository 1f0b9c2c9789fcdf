"""Hand a strategy's partition to :class:`PartitionOffload`: the few facts each stage knows.

Stages 1/2: parameters are chunks of the full flat buffer; gradients are chunks of it too (stage
1) or one flat shard (stage 2). Stage 3: parameters and gradients are per-unit chunks that
concatenate to the partition (``param_store.py`` swaps the parameter chunks when offloaded).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from slipstream.engine.zero.offload.chunks import Chunks
from slipstream.engine.zero.offload.partition import PartitionOffload, shared_job_id

if TYPE_CHECKING:
    from slipstream.engine.zero.partitioned import PartitionedStrategy
    from slipstream.engine.zero.stage3 import Stage3Strategy


def offload_partitioned(strategy: PartitionedStrategy, optimizer: Any, groups: list[Any]) -> PartitionOffload:
    layout = strategy.layout
    params = Chunks([b.shard_offset for b in layout.buckets], [layout.own_chunk(strategy.flat_params, b) for b in layout.buckets])

    def grads() -> Chunks:
        if strategy.stage == 1:
            return Chunks([b.shard_offset for b in layout.buckets], [layout.own_chunk(strategy.flat_grads, b) for b in layout.buckets])
        return Chunks.flat(strategy.grad_shard)
    options = strategy.options.offload
    return PartitionOffload(
        options, numel=layout.shard_numel, pieces=layout.pieces, trainable_of=lambda i: i,
        num_trainable=len(strategy.trainable), groups=groups, index=strategy.index, trainable=strategy.trainable,
        optimizer=optimizer, dtype=strategy.dtype, device=strategy.flat_params.device, grads=grads, initial=params,
        params=params,
        boundaries=[b.shard_offset for b in layout.buckets],
        job_id=shared_job_id(strategy.group) if options.optimizer == "nvme" else "", rank=strategy.rank,
    )  # fmt: skip


def offload_stage3(strategy: Stage3Strategy, optimizer: Any, groups: list[Any], device: Any) -> PartitionOffload:
    layout = strategy.layout

    def grads() -> Chunks:
        units = [u for u in strategy.units if u.index in strategy.grad_chunks]
        return Chunks([u.bucket.shard_offset for u in units], [strategy.grad_chunks[u.index] for u in units])
    store = strategy.param_store
    options = strategy.options.offload
    offload = PartitionOffload(
        options, numel=layout.shard_numel, pieces=layout.pieces,
        trainable_of=lambda i: strategy.index.get(id(strategy.managed[i])), num_trainable=len(strategy.trainable),
        groups=groups, index=strategy.index, trainable=strategy.trainable, optimizer=optimizer, dtype=strategy.dtype,
        device=device, grads=grads, initial=store.initial(), params=store.resident(), publish=store.publish,
        boundaries=[b.shard_offset for b in layout.buckets],
        job_id=strategy.job_id if options.optimizer == "nvme" else "", rank=strategy.rank,
    )  # fmt: skip
    store.drop_initial()
    return offload


def param_store(strategy: Stage3Strategy, device: Any) -> Any:
    """Stage 3's parameter shard placement (a no-op store without ``offload_param``)."""
    from slipstream.engine.zero.offload.param_store import ParamStore
    from slipstream.engine.zero.offload.swap_dir import SwapDir
    from slipstream.ops.aio import AsyncIO

    options = strategy.options.offload
    mode = options.param if options is not None else "none"
    if options is not None and "nvme" in (options.optimizer, options.param):
        strategy.job_id = shared_job_id(strategy.group)
    swap = io = None
    if mode == "nvme":
        swap = SwapDir.open(options.param_nvme_path, strategy.job_id, strategy.rank, "zero_optimization.offload_param.nvme_path")
        io = AsyncIO(options.aio.block_size, options.aio.threads, options.aio.use_direct)
    pin = options is not None and options.pin_memory and device.type == "cuda"
    return ParamStore(mode, strategy.param_shard, strategy.units, device, pin, swap, io)
