"""ZeRO stage 3: parameters, gradients and optimizer state all partitioned; units gathered by hooks.

Each rank keeps only its chunk of every unit (``unit.py``), the matching gradient chunk
(``reducer.py``) and the fp32 masters and optimizer state for it (``masters.py``). A unit's full
parameters exist while its forward or backward runs (``hooks.py``), gathered in a rank-consistent
order (``schedule.py``). This class wires them together and answers the engine's calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from functools import partial

import torch
import torch.distributed as dist

from slipstream import comm
from slipstream.accelerator import get_accelerator
from slipstream.comm.context import CommContext
from slipstream.engine.config.base import ConfigError
from slipstream.engine.zero.flat_layout import FlatLayout
from slipstream.engine.zero.init import leave_presharded
from slipstream.engine.zero.masters import build_masters
from slipstream.engine.zero.masters_strategy import MastersStrategy, Piece
from slipstream.engine.zero.offload.param_store import open_param_store
from slipstream.engine.zero.offload.swap_dir import shared_job_id
from slipstream.engine.zero.params import check_groups, single_dtype
from slipstream.engine.zero.partition import OptimizedPiece, PartitionSpec
from slipstream.engine.zero.slices import OwnedSlice, slice_of
from slipstream.engine.zero.stage3.buffers import UnitBuffers
from slipstream.engine.zero.stage3.gathered import PartitionedUnits
from slipstream.engine.zero.stage3.hooks import UnitHooks
from slipstream.engine.zero.stage3.reducer import UnitReducer
from slipstream.engine.zero.stage3.schedule import GatherSchedule
from slipstream.engine.zero.stage3.sharding import GroupLayout, shard_units, split_units
from slipstream.engine.zero.stage3.unit import GroupLanes, ParamUnit, UnitState
from slipstream.engine.zero.stage3.units import find_units
from slipstream.engine.zero.strategy import OptimizerFactory, ParamGroupSpec, ShardingOptions
from slipstream.engine.zero.used_flags import UsedFlags
from slipstream.utils.logging import get_logger

logger = get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class Stage3Options:
    unit_classes: list[str] | None = None
    persistence_threshold: int = 100_000  # elements; smaller parameters stay gathered
    prefetch_numel: int | None = None  # gather ahead while the units ahead hold fewer elements; None: the next unit
    max_live_numel: int = 1_000_000_000  # never prefetch beyond this many gathered elements
    max_reuse_numel: int | None = None  # keep a unit gathered into its backward when reused within this many elements
    hpz_size: int = 1  # ZeRO++ hpZ: ranks of the secondary partition (zero_hpz_partition_size); 1: none
    mics_shard_size: int = -1  # MiCS: ranks per shard group; -1: the whole group
    weight_bits: int = 0  # ZeRO++ qwZ (zero_quantized_weights): 8; 0: full precision
    gradient_bits: int = 0  # ZeRO++ qgZ (zero_quantized_gradients): 4; 0: full precision


@dataclasses.dataclass(frozen=True)
class Hierarchy:
    """hpZ's or MiCS's groups, and qgZ's, for parameters sharded over the default group (``engine/sharding.py`` makes them).

    ``kind`` "hpz": ``block`` is the secondary partition's group (a node). "mics": ``block`` is the
    shard group the parameters are partitioned over, ``across`` its replicas. None: neither.
    ``nodes`` (qgZ, the default group spanning several nodes): its node blocks and the groups
    across them, for the two-hop reduce-scatter ([Note: quantize only what crosses nodes])."""

    kind: str | None
    block: dist.ProcessGroup | None
    across: dist.ProcessGroup | None
    nodes: tuple[dist.ProcessGroup, dist.ProcessGroup | None] | None = None


def lanes_of(h: Hierarchy | None, default: dist.ProcessGroup | None, group: dist.ProcessGroup | None) -> GroupLanes:
    """The default group's partition gets hpZ's secondary or MiCS's replicas; groups the user named get neither."""
    if h is not None and h.kind == "mics" and group is h.block:
        return GroupLanes.of(group, replicas=h.across, data=default)
    if h is not None and group is default:
        return GroupLanes.of(group, secondary=h.block if h.kind == "hpz" else None, nodes=h.nodes)
    return GroupLanes.of(group)


def optimized_pieces(groups: list, managed: list[torch.nn.Parameter], index: dict[int, int]) -> list[OptimizedPiece]:
    """The trainable pieces of this rank's shard, each with its parameter's index (frozen ones are not optimized)."""
    return [
        OptimizedPiece(g.base + piece.shard_offset, piece.numel, index[id(managed[piece.index])])
        for g in groups
        for piece in g.layout.pieces
        if id(managed[piece.index]) in index
    ]


def _log_units(units: list, owned: int) -> None:
    shown = ", ".join(f"{u.spec.name}:{u.numel}" for u in units[:4]) + ("..." if len(units) > 4 else "")
    total = sum(u.numel for u in units)
    logger.debug("ZeRO stage 3: %d units (%s), %d of %d elements owned by this rank", len(units), shown, owned, total)


class Stage3Strategy(MastersStrategy):
    def __init__(
        self,
        module: torch.nn.Module,
        groups: list[ParamGroupSpec],
        options: ShardingOptions,
        optimizer: torch.optim.Optimizer | OptimizerFactory,
        stage3: Stage3Options,
        preshard: Callable[[FlatLayout], torch.Tensor] | None = None,
        hierarchy: Hierarchy | None = None,
    ) -> None:
        """``preshard``: zero.Init built this rank's shards without ever holding the full model; ``hierarchy``: hpZ or MiCS."""
        self.module, self.options = module, options
        specs = find_units(module, stage3.unit_classes, stage3.persistence_threshold)
        self.names = {id(p): n for n, p in module.named_parameters()}
        managed = [p for spec in specs for p in spec.params]
        self.trainable = [p for p in managed if p.requires_grad]
        self.index = {id(p): i for i, p in enumerate(self.trainable)}
        check_groups(groups, self.index, self.names)
        self.dtype = single_dtype(managed, 3)
        device = managed[0].device if managed else torch.device("cpu")
        self.hierarchy = hierarchy
        mics = hierarchy is not None and hierarchy.kind == "mics" and hierarchy.block is not None
        if mics and preshard is not None:
            raise ConfigError(
                "zero_optimization.mics_shard_size: a model built under slipstream.zero.Init is sharded over every rank; "
                "build it without zero.Init to shard it over MiCS groups"
            )
        default = hierarchy.block if mics else options.group  # type: ignore[union-attr]
        group_of = {id(p): g.sharding_group(default) for g in groups for p in g.params}
        sharded = shard_units(
            split_units(specs, lambda p: group_of.get(id(p), default)),
            self.dtype,
            device,
            preshard,
            partial(lanes_of, hierarchy, options.group),
        )
        self.units, self.groups, self.managed = sharded.units, sharded.groups, sharded.managed
        self.comm_context = CommContext()  # streams and events of every collective below (comm/context.py)
        self.buffers = UnitBuffers()
        for unit in self.units:  # persistent units stay gathered in memory of their own
            unit.context, unit.buffers = self.comm_context, self.buffers if unit.kind != "persistent" else None
            unit.weight_bits = stage3.weight_bits if unit.kind != "persistent" else 0  # refreshed once a step: exact
        offload = options.offload
        nvme = offload is not None and "nvme" in (offload.optimizer, offload.param)
        job_id = shared_job_id(options.group) if nvme else ""
        rank = dist.get_rank(options.group)
        self.param_store = open_param_store(offload, sharded.shard, self.units, device, job_id, rank)
        get_accelerator().return_freed_memory(min((u.nbytes for u in self.units if u.kind != "persistent"), default=0))
        self.blocks = [u for u in self.units if u.kind == "block"]
        self.roots = [u for u in self.units if u.kind == "root"]
        self.persistent = [u for u in self.units if u.kind == "persistent"]
        for unit in self.persistent:
            unit.refresh()
        store = self.param_store
        spec = PartitionSpec(
            numel=sharded.shard.numel(),
            pieces=tuple(optimized_pieces(self.groups, self.managed, self.index)),
            num_params=len(self.trainable),
            boundaries=tuple(u.offset for u in self.units),
            dtype=self.dtype,
            device=device,
            rank=rank,
            job_id=job_id,
            initial=store.initial(),
            grads=lambda: self.reducer.grads(),
            params=store.resident(),
            publish=store.publish,
        )
        self.masters = build_masters(spec, offload, optimizer, groups, self.index)
        self.optimizer = self.masters.optimizer
        store.drop_initial()
        self.used = UsedFlags(len(self.trainable), device)  # [Note: flags on the host]
        self.flag_groups = _flag_groups(self.groups, self.units, self.index)
        reduce_order = [*reversed(self.blocks), *self.roots, *self.persistent]
        self.reducer = UnitReducer(
            self.units,
            reduce_order,
            options,
            self.dtype,
            device,
            self.used,
            self.index,
            lambda u: self.masters.gradient_buffer(f"grad_{u.index:05d}", u.chunk),
            self.buffers,
        )
        self.reducer.context = self.comm_context
        self.reducer.gradient_bits = stage3.gradient_bits
        self.schedule = GatherSchedule(
            self.blocks,
            self.units,
            stage3.prefetch_numel,
            stage3.max_live_numel,
            self.reducer.unit_done,
            stage3.max_reuse_numel,
        )
        self.unit_hooks = UnitHooks(self.roots, self.blocks, self.schedule, self.reducer, self.buffers, self)
        self.hooks = self.unit_hooks.register(module)
        self.gathered = PartitionedUnits(self.units, store, self.masters)
        self.gathered.register()
        _log_units(self.units, spec.numel)
        self.zero_grad()

    # ------------------------------------------------------------------ backward
    def begin_backward(self, sync: bool) -> None:
        pass  # ZeRO-3 reduces every micro-step: no rank keeps a full gradient between them

    def end_backward(self) -> None:
        """Complete the backward pass: every unit reduced exactly once on every rank, all freed."""
        units = [*self.schedule.end_backward(), *self.roots, *self.persistent]
        for unit in units:
            unit.pending_backward = 0
            unit.reshard()
        self.reducer.end_backward(units)

    @contextlib.contextmanager
    def accumulation_window(self) -> Iterator[None]:
        """Every unit gathered once for the whole window, gradients accumulated over it, one reduce-scatter each on exit."""
        with self._all_gathered(reduce=True):
            yield

    @contextlib.contextmanager
    def set_aside(self) -> Iterator[None]:
        """Every unit gathered, the hooks standing aside, nothing reduced: the base class's contract for ZeRO-3
        (the whole model on every rank for the duration, as before sharding at ``initialize``)."""
        with self._all_gathered(reduce=False):
            yield

    @contextlib.contextmanager
    def _all_gathered(self, reduce: bool) -> Iterator[None]:
        """Every unit gathered and the unit hooks standing aside; on exit (``reduce``: the accumulated gradients
        reduce-scattered first) every unit's bookkeeping reset and its parameters freed."""
        for unit in self.units:
            unit.gathered(exact=not reduce)  # set aside: the model as it is, for uses outside training (no qwZ)
            if reduce:
                self.reducer.remember_grads(unit)
        self.unit_hooks.held = True
        try:
            yield
        finally:
            self.unit_hooks.held = False
            for unit in self.units:
                unit.pending_backward = 0
                unit.depth = 0
            if reduce:
                self.reducer.end_backward(self.units)
            for unit in self.units:
                unit.reshard()
            self.buffers.shrink()

    def finish_gradients(self) -> None:
        self.reducer.finish(self.units)
        self._gradients_final(self.flag_groups)

    # ------------------------------------------------------------------ step
    def _ranges(self) -> list[tuple[dist.ProcessGroup | None, int, int]]:
        return [(g.lanes.group, g.base, g.base + g.layout.shard_numel) for g in self.groups]

    def step(self) -> None:
        self.masters.step()
        self._show_masters()
        # Not a trim every step: only once the heap has grown past its steady state
        # (accelerator/cpu.py, [Note: trimming the heap, rarely]).
        get_accelerator().release_freed_memory()

    def _show_masters(self) -> None:  # the partitioned units gather the new shards when next needed
        for unit in self.units:
            unit.shard_changed()
        with torch.no_grad():
            for unit in self.persistent:
                unit.refresh()

    def zero_grad(self) -> None:
        self.reducer.zero()
        self.masters.zero_grad()
        for p in self.managed:
            p.grad = None
        self.used.reset()

    # ------------------------------------------------------------------ state
    def consolidated_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Gathers one unit at a time, so ranks other than 0 never hold more than one unit in full."""
        state: dict[str, torch.Tensor] = {}
        for unit in self.units:
            flat = torch.empty(unit.numel, dtype=torch.float32, device=self.used.device)
            own = flat.view(unit.lanes.world, -1)[unit.lanes.rank]
            own.copy_(self.masters.read(unit.offset, unit.offset + unit.chunk))
            comm.all_gather_into_tensor(
                flat, own, group=unit.lanes.group, tag=f"fp32 weights of unit {unit.index}"
            ).wait()
            if dist.get_rank() == 0:
                for p, begin, end in unit.ranges():
                    state[self.names[id(p)]] = flat[begin:end].view(p.shape).clone()
        if dist.get_rank() != 0:
            return None
        return {name: state[name] for name, _ in self.module.named_parameters()}  # the model's order

    def _pieces(self) -> list[Piece]:
        pieces: list[Piece] = []
        for g in self.groups:  # frozen parameters too: they are partitioned like the rest
            for piece in g.layout.pieces:
                p = self.managed[piece.index]
                where = slice_of(self.names[id(p)], p, piece.param_offset, piece.numel)
                pieces.append((p, where, g.base + piece.shard_offset, g.lanes.group))
        return pieces

    def sharded_state(self) -> list[OwnedSlice]:
        return self._owned_slices()

    def memory_breakdown(self) -> dict[str, int]:
        persistent = sum(u.nbytes for u in self.persistent)
        persistent += sum(u.secondary.nbytes for u in self.units if u.secondary is not None)  # hpZ's copy
        live = sum(u.nbytes for u in self.units if u.state is not UnitState.FREE and u.kind != "persistent")
        return {
            "params": self.param_store.memory_bytes() + persistent,
            "grads": self.reducer.grad_bytes(),
            "optimizer": self.masters.memory_bytes(),  # offload: CPU memory (NVMe: buffers only)
            "buffers": live + self.buffers.held_bytes(),
        }

    def leave_partitioned(self) -> bool:
        """Close without gathering: each rank's shard is handed to the model's next engine as zero.Init's would be.

        A model loaded straight into shards (``from_pretrained`` into ZeRO-3) first gets an engine
        without an optimizer; training then builds another. Closing would give every rank the whole
        model, which is what loading into shards avoids. Only one sharding group and a shard in
        memory (not swapped to NVMe) can be handed on.
        """
        if len(self.groups) != 1 or self.param_store.mode == "nvme" or self.groups[0].lanes.replicas is not None:
            return False
        layout = self.groups[0].layout
        self.gathered.unregister()
        for unit in self.units:
            unit.reshard()
        super().close()
        self.param_store.close()
        leave_presharded(self.module, layout.world, [b.numel for b in layout.buckets], self.param_store.shard)
        return True

    def close(self) -> None:
        """Remove the hooks and give every parameter its full value back as an ordinary tensor."""
        self.gathered.unregister()
        for unit in self.units:
            unit.detach()
        super().close()
        self.param_store.close()


def _flag_groups(
    groups: list[GroupLayout], units: list[ParamUnit], index: dict[int, int]
) -> list[tuple[dist.ProcessGroup | None, list[int]]]:
    """Each lane group's data group and the trainable indices its units hold: the used flags' reduction (fixed at
    set-up, so made once rather than per step)."""
    flags = {id(g.lanes): (g.lanes.data, []) for g in groups}  # MiCS: replicas saw other data
    for unit in units:
        flags[id(unit.lanes)][1].extend(index[id(p)] for p in unit.params if id(p) in index)
    return list(flags.values())
