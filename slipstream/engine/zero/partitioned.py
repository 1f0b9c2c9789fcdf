"""ZeRO stages 1 and 2: optimizer state (1) and gradients too (2) partitioned across ranks.

Each sharding group's parameters live in a :class:`GroupPartition` (flat buffer, buckets,
reduce-scatter, all-gather); the stage only chooses where gradients wait for their reduction
(``grad_storage.py``). This rank's fp32 masters and optimizer state cover its chunks of every
partition, through one :class:`MasterWeights` (on the device or offloaded).

* Stage 1 keeps full-size gradients (``param.grad`` are views into a flat buffer, accumulated in
  place); at the boundary each bucket is reduce-scattered and a rank keeps only its chunk.
* Stage 2 keeps no full-size gradient buffer: when a bucket's gradients are complete they are
  packed, reduce-scattered into the rank's gradient shard and the full gradients freed at once.
  With gradient accumulation the full gradients accumulate locally between boundaries (one
  collective per optimizer step instead of one per micro-step).

After the step the updated chunks return to every rank with one all-gather per bucket.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from slipstream.comm.context import CommContext
from slipstream.engine.zero.flat_layout import FlatLayout
from slipstream.engine.zero.grad_storage import FullGradients, ShardedGradients
from slipstream.engine.zero.group_partition import GroupPartition, StorageFactory
from slipstream.engine.zero.masters import build_masters
from slipstream.engine.zero.masters_strategy import MastersStrategy, Piece
from slipstream.engine.zero.offload.chunks import join
from slipstream.engine.zero.offload.swap_dir import shared_job_id
from slipstream.engine.zero.params import TrainableParams, single_dtype
from slipstream.engine.zero.partition import OptimizedPiece, PartitionSpec
from slipstream.engine.zero.sharding_groups import first_of, split_by_group
from slipstream.engine.zero.slices import OwnedSlice, slice_of
from slipstream.engine.zero.strategy import OptimizerFactory, ParamGroupSpec, ShardingOptions
from slipstream.engine.zero.used_flags import UsedFlags
from slipstream.utils.logging import get_logger
from slipstream.utils.placement import is_duplicate

logger = get_logger(__name__)


def _storage(
    stage: int, trainable: list[torch.nn.Parameter], dtype: torch.dtype, device: torch.device, overlap: bool
) -> StorageFactory:
    """The one place where stages 1 and 2 differ: full-size gradients, or a shard and send buffers."""
    if stage == 1:
        return lambda layout, inflight: FullGradients(layout, trainable, dtype, device)
    return lambda layout, inflight: ShardedGradients(layout, trainable, dtype, device, 2 if overlap else 1, inflight)


class PartitionedStrategy(MastersStrategy):
    def __init__(
        self,
        module: torch.nn.Module,
        groups: list[ParamGroupSpec],
        options: ShardingOptions,
        optimizer: torch.optim.Optimizer | OptimizerFactory,
        stage: int,
    ) -> None:
        if stage not in (1, 2):
            raise ValueError(f"PartitionedStrategy implements ZeRO stages 1 and 2, got {stage}")
        self.options, self.module = options, module
        params = TrainableParams(module, groups)
        self.names, self.trainable, self.index = params.names, params.trainable, params.index
        self.dtype = single_dtype(self.trainable, stage)
        device = self.trainable[0].device if self.trainable else torch.device("cpu")
        storage = _storage(stage, self.trainable, self.dtype, device, options.overlap_comm)
        self.parts: list[GroupPartition] = []
        self.comm_context = CommContext()  # streams and events of every collective below (comm/context.py)
        for share in split_by_group(groups, options.group):
            members = [[self.index[id(p)] for p in g.params if id(p) in self.index] for g in share.specs]
            base = sum(part.numel for part in self.parts)
            self.parts.append(
                GroupPartition(
                    share.group, self.trainable, members, options, storage, base, self.dtype, device, self.comm_context
                )
            )
        self.part_of = {i: part for part in self.parts for i in part.indices}
        params_chunks = join([part.params() for part in self.parts])
        nvme = options.offload is not None and options.offload.optimizer == "nvme"
        spec = PartitionSpec(
            numel=sum(part.numel for part in self.parts),
            pieces=tuple(
                OptimizedPiece(part.base + piece.shard_offset, piece.numel, piece.index)
                for part in self.parts
                for piece in part.layout.pieces
            ),
            num_params=len(self.trainable),
            boundaries=tuple(b for part in self.parts for b in part.boundaries()),
            dtype=self.dtype,
            device=device,
            rank=dist.get_rank(options.group),
            job_id=shared_job_id(options.group) if nvme else "",
            initial=params_chunks,
            grads=lambda: join([part.grads.chunks(part.base) for part in self.parts]),
            params=params_chunks,
        )
        self.masters = build_masters(spec, options.offload, optimizer, groups, self.index)
        self.optimizer = self.masters.optimizer
        self.used = UsedFlags(len(self.trainable), device)  # [Note: flags on the host]
        self.hooks = [part.attach(self.trainable, self.used.local) for part in self.parts]
        logger.debug(
            "ZeRO stage %d: %d sharding group(s), %d buckets, %d elements owned by this rank",
            stage,
            len(self.parts),
            sum(len(p.layout.buckets) for p in self.parts),
            spec.numel,
        )
        self.zero_grad()

    @property
    def layout(self) -> FlatLayout:
        """The first sharding group's layout (the only one unless parameter groups name their own group)."""
        return self.parts[0].layout

    # ------------------------------------------------------------------ backward
    def begin_backward(self, sync: bool) -> None:
        for part in self.parts:
            part.arrivals.before_backward(sync)

    @property  # type: ignore[override]
    def aside(self) -> bool:
        return any(part.arrivals.aside for part in self.parts)

    @aside.setter
    def aside(self, value: bool) -> None:
        for part in self.parts:
            part.arrivals.aside = value

    def _on_grad(self, param: torch.Tensor) -> None:
        """A gradient that reached ``.grad`` without autograd's accumulator (adopt_gradients)."""
        i = self.index[id(param)]
        part = self.part_of.get(i)
        if part is not None:  # else in no optimizer group: never updated
            part.arrivals.arrive(part.indices.index(i))

    def finish_gradients(self) -> None:
        for part in self.parts:
            part.finish()
        self._gradients_final([(part.group, part.indices) for part in self.parts])
        for part in self.parts:
            part.arrivals.sync = False

    # ------------------------------------------------------------------ step
    def _ranges(self) -> list[tuple[dist.ProcessGroup | None, int, int]]:
        return [(part.group, part.base, part.base + part.numel) for part in self.parts]

    def step(self) -> None:
        self.masters.step()  # updates this rank's chunks of the flat parameters
        self._all_gather("updated weights")

    def _show_masters(self) -> None:
        self._all_gather("loaded weights")

    def _all_gather(self, what: str) -> None:
        for part in self.parts:
            part.all_gather(part.flat_params, what)

    def zero_grad(self) -> None:
        for part in self.parts:
            part.zero_grad()
        self.masters.zero_grad()
        self.used.reset()

    # ------------------------------------------------------------------ state
    def consolidated_state_dict(self) -> dict[str, torch.Tensor] | None:
        fulls = {}
        for part in self.parts:
            full = part.flat_params
            if self.dtype != torch.float32:  # the fp32 masters, not the rounded parameters
                full = torch.zeros(part.layout.numel, dtype=torch.float32, device=full.device)
                part.write_own(full, self.masters.read)
                part.all_gather(full, "fp32 master weights")
            fulls[id(part)] = full
        if dist.get_rank() != 0:
            return None
        state = {}
        for name, p in self.module.named_parameters():
            i = self.index.get(id(p))
            part = self.part_of.get(i) if i is not None else None
            value = part.param_view(fulls[id(part)], i, p.shape) if part is not None else p
            state[name] = value.detach().float().clone()
        return state

    def _pieces(self) -> list[Piece]:
        pieces: list[Piece] = []
        for part in self.parts:
            for piece in part.layout.pieces:
                p = self.trainable[piece.index]
                where = slice_of(self.names[id(p)], p, piece.param_offset, piece.numel)
                pieces.append((p, where, part.base + piece.shard_offset, part.group))
        return pieces

    def sharded_state(self) -> list[OwnedSlice]:
        owned = self._owned_slices()
        saver = first_of(self.options.group)
        for name, p in self.module.named_parameters():  # frozen or outside every optimizer group: replicated
            if self.index.get(id(p)) not in self.part_of:
                duplicate = not saver or is_duplicate(p)
                owned.append(
                    OwnedSlice(slice_of(name, p), p.detach().view(-1), None, replicated=True, duplicate=duplicate)
                )
        return owned

    def memory_breakdown(self) -> dict[str, int]:
        return {
            "params": sum(part.flat_params.numel() * part.flat_params.element_size() for part in self.parts),
            "grads": sum(part.grads.nbytes() for part in self.parts),
            "optimizer": self.masters.memory_bytes(),
            "buffers": sum(part.grads.buffer_bytes() for part in self.parts),
        }
