"""One ZeRO-3 unit at run time: its flat gathered buffer and its lifecycle around compute.

Like FSDP2's ``FSDPParamGroup``, the unit owns its lifecycle: ``unshard`` (start the all-gather),
``wait``, ``reshard`` (free), and the bookkeeping of the forward and backward passes that decide
when it may be freed and when its gradients are complete (``pre_forward``/``post_forward``,
``pre_backward``/``post_backward``). Which unit to gather when is the schedule's business
(``schedule.py``); what happens to its gradients, the reducer's (``reducer.py``).

[Note: freeing without rebinding] Each parameter of a unit is, once at set-up, made a view into
the unit's flat ``full`` buffer. Releasing the unit resizes that buffer's storage to zero bytes;
gathering resizes it back and fills it. Parameters and the tensors autograd saved from them keep
pointing at the same storage, so nothing is rebound behind autograd's back and a saved weight
is valid again as soon as the unit is re-gathered for backward. The collective writes through a
separate alias of the storage, so the parameters' version counters never move (autograd would
otherwise report an in-place modification).

[Note: hpZ's secondary partition] ZeRO++'s hpZ keeps a second, intra-node partition of each unit:
with ``zero_hpz_partition_size`` h, a rank also holds 1/h of the unit (its position in its block
of h consecutive ranks, one node). The first gather after the weights change reads the primary
shards across every rank of the group (the forward, across nodes); releasing the unit then copies
this rank's 1/h into ``secondary``, and every later gather until the weights change again (the
backward; the forwards of later micro-steps) all-gathers the secondary pieces inside the block.
Values are bit-identical to plain ZeRO-3's: the same bytes, gathered from another copy. Gradients
are reduce-scattered over the whole group as before. Cost: 1/h of each unit per rank, kept.
"""

from __future__ import annotations

import dataclasses
import enum
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from slipstream import comm
from slipstream.comm.context import CommContext, Pending
from slipstream.comm.quantized import all_gather_quantized
from slipstream.comm.topology import INTER, link_class
from slipstream.engine.zero.flat_layout import FlatLayout, LayoutBucket
from slipstream.engine.zero.stage3.buffers import UnitBuffers
from slipstream.engine.zero.stage3.units import UnitSpec
from slipstream.engine.zero.storage import alias
from slipstream.errors import UsageError
from slipstream.utils.logging import get_logger

logger = get_logger(__name__)

_HARMLESS = {
    "shape",
    "size",
    "dim",
    "numel",
    "dtype",
    "device",
    "requires_grad",
    "requires_grad_",
    "grad",
    "data",
    "is_leaf",
    "untyped_storage",
    "element_size",
    "stride",
    "storage_offset",
    "ndim",
    "layout",
    "is_meta",
    "is_cuda",
    "is_sparse",
    "is_floating_point",
    "_version",
    "grad_fn",
    "name",
    "__get__",
    "__set__",
    "register_post_accumulate_grad_hook",
    "register_hook",
    "__hash__",
    "__eq__",
    "__reduce_ex__",
    "_is_view",
    "is_quantized",
    "is_complex",
    "nbytes",
    "itemsize",
    "_has_compatible_shallow_copy_type",
}


_MOVES = {"cpu", "cuda", "to"}
_placeholder_noted = False


class ReleasedParameter(torch.nn.Parameter):
    """The class a partitioned parameter wears while its unit is not gathered.

    Its storage is empty then; an elementwise kernel would read a null pointer and crash the
    process, so every computation on it raises an explanation instead. Reading its metadata
    (shape, dtype, grad, ...) stays allowed. Torch itself switches a parameter's class this way
    (``UninitializedParameter``).

    [Note: what hosts call on a partitioned model] Hosts call a few module-wide methods that
    DeepSpeed tolerates at ZeRO-3, and a finished run must not end in an exception there:
    - ``module.cpu()`` / ``.to(device)`` / ``.cuda()`` (Lightning's teardown, ``initialize`` on a
      model loaded into shards): moving a partitioned parameter is meaningless, since the engine
      owns where its shard lives, so the move returns the parameter itself (still released:
      computing with it still raises). A *dtype* change is refused: the engine's precision
      section decides the dtype.
    - ``module.state_dict()`` (transformers' ``save_pretrained`` on a rank where Accelerate's
      ``get_state_dict`` returned None): each partitioned parameter is saved as an empty
      placeholder, as DeepSpeed's are; loading one fails on its shape, never silently. Only
      ``Module._save_to_state_dict`` gets a placeholder: any other ``detach`` still raises.
    """

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in _HARMLESS or getattr(getattr(func, "__self__", None), "__name__", "") in _HARMLESS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        if name in _MOVES and args and isinstance(args[0], ReleasedParameter):
            _refuse_dtype_change(name, args[0], args[1:], kwargs or {})
            return args[0]
        if name == "detach" and args and sys._getframe(1).f_code is _SAVE_TO_STATE_DICT:
            return _state_dict_placeholder(args[0])
        raise UsageError(
            f"ZeRO-3: {name or func} used a partitioned parameter while its unit was not gathered (a parameter used "
            "outside its owning module's forward, a submodule called outside the model's forward, or model.state_dict() "
            "instead of engine.consolidated_state_dict()). Declare outside uses with "
            "slipstream.zero.register_external_parameter(module_that_uses_it, parameter) before initialize(), name a "
            "module enclosing both in zero_optimization.stage3_unit_modules, or wrap the access in "
            "slipstream.zero.GatheredParameters(params)"
        )

    def __repr__(self) -> str:
        return f"ReleasedParameter(shape={tuple(self.shape)}, dtype={self.dtype}; gather with slipstream.zero.GatheredParameters)"


_SAVE_TO_STATE_DICT = torch.nn.Module._save_to_state_dict.__code__


def _refuse_dtype_change(name: str, param: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A move to another dtype (``model.half()``, ``.to(torch.bfloat16)``) cannot be honoured by a partitioned parameter."""
    wanted = kwargs.get("dtype")
    for arg in args:
        if isinstance(arg, torch.dtype):
            wanted = arg
        elif isinstance(arg, torch.Tensor):
            wanted = arg.dtype
    if wanted is not None and wanted != param.dtype:
        raise UsageError(
            f"ZeRO-3: {name}(dtype={wanted}) on a partitioned parameter of dtype {param.dtype}: the engine's precision "
            "section (bf16/fp16) sets the dtype of ZeRO-3 parameters; cast the model before slipstream.initialize()"
        )


def _state_dict_placeholder(param: torch.Tensor) -> torch.Tensor:
    global _placeholder_noted
    if not _placeholder_noted:
        _placeholder_noted = True
        logger.warning(
            "ZeRO-3: module.state_dict() saves partitioned parameters as empty placeholders, as DeepSpeed does; "
            "for the weights use engine.consolidated_state_dict() (collective) or slipstream.zero.GatheredParameters"
        )
    return torch.empty(0, dtype=param.dtype, device=param.device)


class UnitState(enum.Enum):
    """Where the unit's gathered storage is."""

    FREE = "free"
    GATHERING = "gathering"
    LIVE = "live"


class TrainingState(enum.Enum):
    """Where the unit is in the current backward pass."""

    IDLE = "idle"  # no backward under way for it (forward, or between passes)
    PRE_BACKWARD = "pre_backward"  # gathered for backward; gradients arriving
    POST_BACKWARD = "post_backward"  # gradients handed to the reducer for this pass


@dataclasses.dataclass(frozen=True)
class SecondaryLanes:
    """hpZ's secondary partition: the block of ranks (one node) that re-gathers a unit for its backward."""

    group: dist.ProcessGroup
    gather: dist.ProcessGroup | None
    world: int
    rank: int


@dataclasses.dataclass(frozen=True)
class GroupLanes:
    """One sharding group and its twin groups: all-gathers and reduce-scatters each keep their own order.

    ``replicas`` (MiCS): the ranks holding the same partition in the other shard groups, across which
    the reduced gradient chunks are summed once per step; ``data`` is then the whole data-parallel
    group, the ranks whose gradients this partition averages. ``secondary`` (hpZ): see
    :class:`SecondaryLanes` and [Note: hpZ's secondary partition].
    """

    group: dist.ProcessGroup | None
    gather: dist.ProcessGroup | None
    reduce: dist.ProcessGroup | None
    world: int
    rank: int
    replicas: dist.ProcessGroup | None = None
    data: dist.ProcessGroup | None = None
    secondary: SecondaryLanes | None = None
    nodes: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = (
        None  # qgZ: reduce lanes inside each node, and across nodes
    )
    crosses_nodes: bool = False  # the group spans several nodes (comm/topology.py)

    @staticmethod
    def of(
        group: dist.ProcessGroup | None,
        replicas: dist.ProcessGroup | None = None,
        data: dist.ProcessGroup | None = None,
        secondary: dist.ProcessGroup | None = None,
        nodes: tuple[dist.ProcessGroup, dist.ProcessGroup | None] | None = None,
    ) -> GroupLanes:
        """``data`` defaults to ``group`` (no replicas: the partition's ranks are all the data's)."""
        second = None
        if secondary is not None:
            second = SecondaryLanes(
                secondary,
                comm.lane_group(secondary, "zero3-hpz-gather"),
                dist.get_world_size(secondary),
                dist.get_rank(secondary),
            )
            comm.ring_context(second.gather)
        node_lanes = None
        if nodes is not None and nodes[1] is not None:
            node_lanes = (comm.lane_group(nodes[0], "zero3-qgz-node"), comm.lane_group(nodes[1], "zero3-qgz-across"))
            for lane in node_lanes:
                comm.ring_context(lane)
        ranks = tuple(range(dist.get_world_size())) if group is None else tuple(dist.get_process_group_ranks(group))
        lanes = GroupLanes(
            group,
            comm.lane_group(group, "zero3-gather"),
            comm.lane_group(group, "zero3-reduce"),
            dist.get_world_size(group),
            dist.get_rank(group),
            replicas,
            group if replicas is None else data,
            second,
            node_lanes,  # type: ignore[arg-type]
            link_class(ranks) == INTER,
        )
        comm.ring_context(lanes.gather)  # set up now rather than inside a hook
        comm.ring_context(lanes.reduce)
        comm.ring_context(group)  # the used flags and the norm's all-reduce (through shared memory on one host)
        return lanes

    @property
    def average_world(self) -> int:
        """How many ranks' gradients the partition averages: its group's, times its replicas (MiCS)."""
        return self.world * (1 if self.replicas is None else dist.get_world_size(self.replicas))


class ParamUnit:
    """The flat buffer of one unit, this rank's chunk of it, and the collective that fills it."""

    def __init__(
        self,
        spec: UnitSpec,
        bucket: LayoutBucket,
        layout: FlatLayout,
        shard: torch.Tensor,
        lanes: GroupLanes,
        base: int,
    ) -> None:
        """``shard``: this rank's chunk; ``base``: where the unit's group starts in partition coordinates."""
        self.spec, self.bucket, self.layout, self.lanes = spec, bucket, layout, lanes
        self.index, self.kind, self.numel = spec.index, spec.kind, bucket.numel
        self.offset, self.chunk = base + bucket.shard_offset, bucket.chunk  # this rank's chunk in partition coordinates
        self.shard = shard  # persistent between steps
        self.full = torch.empty(bucket.numel, dtype=shard.dtype, device=shard.device)
        self.nbytes = self.full.untyped_storage().nbytes()
        self.flat = alias(
            self.full.untyped_storage(), 0, (bucket.numel,), shard.dtype
        )  # what collectives write through
        self.state = UnitState.LIVE
        self.training_state = TrainingState.IDLE
        self.work: Pending | None = None
        self.context: CommContext = CommContext()  # the strategy's, set when it adopts the unit
        self.buffers: UnitBuffers | None = None  # the strategy's pool, set when it adopts the unit (buffers.py)
        self.fetch: Callable[[], torch.Tensor] | None = None  # offloaded shard: brings it to the device
        self.staged: torch.Tensor | None = None  # what the all-gather reads, alive until it completes
        self.depth = 0  # active forward calls
        self.pending_backward = 0  # forward calls under grad whose backward has not finished
        self.secondary: torch.Tensor | None = None
        self.weight_bits = 0  # qwZ: gathers from the primary shards travel as INT8 (set by the strategy)
        self.secondary_current = False  # holds the weights the primary shards hold now
        self._ranges: list[tuple[torch.nn.Parameter, int, int]] | None = None
        self.adopt()
        self.reshard()  # ``full`` holds nothing yet: the secondary copy starts after this
        if lanes.secondary is not None and spec.kind != "persistent":  # [Note: hpZ's secondary partition]
            self.secondary = torch.empty(bucket.numel // lanes.secondary.world, dtype=shard.dtype, device=shard.device)

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return self.spec.params

    @property
    def trainable(self) -> bool:
        return any(p.requires_grad for p in self.spec.params)

    def param_range(self, slot_index: int) -> tuple[int, int]:
        slot = self.layout.slots[slot_index]
        assert slot is not None
        begin = slot.start - self.bucket.start
        return begin, begin + slot.numel

    def ranges(self) -> list[tuple[torch.nn.Parameter, int, int]]:
        """Each parameter with its ``[begin, end)`` inside the gathered buffer (fixed at set-up: made once, read every
        backward)."""
        if self._ranges is None:
            self._ranges = [(p, *self.param_range(i)) for p, i in zip(self.spec.params, self.bucket.members)]
        return self._ranges

    def adopt(self) -> None:
        """Make the parameters views into ``full`` (once, at set-up, before any graph exists)."""
        for p, begin, end in self.ranges():
            p.data = self.full[begin:end].view(p.shape)

    # ------------------------------------------------------------------ storage
    def unshard(self, exact: bool = False, inline: bool = False) -> None:
        """Start filling ``full`` from every rank's chunk (asynchronous). ``exact``: never quantized (qwZ), for values
        that leave the training step: ``GatheredParameters``, the weights handed back at close. ``inline``: the caller
        waits at once (comm's [Note: waited-for collectives run inline])."""
        if self.state is not UnitState.FREE:
            return
        storage = self.full.untyped_storage()
        if self.buffers is None:
            storage.resize_(self.nbytes)
        else:  # a resident buffer, no fresh pages ([Note: gathered units borrow resident buffers])
            self.buffers.fill(storage, self.nbytes)
        self._mark(released=False)
        tag = f"ZeRO-3 unit {self.index} ({self.spec.name})"
        if self.secondary_current and not (exact and self.weight_bits):  # qwZ's secondary holds decoded INT8 values
            assert self.lanes.secondary is not None
            self.staged, group, tag = (
                self.secondary,
                self.lanes.secondary.gather,
                tag + " from the node's secondary partition",
            )
        else:
            self.staged, group = self.shard if self.fetch is None else self.fetch(), self.lanes.gather
        staged, bits = self.staged, self.weight_bits if group is self.lanes.gather and not exact else 0
        if bits:  # qwZ: across the whole group, block-quantized ([Note: block-wise quantization] in comm/quantized.py)
            self.work = self.context.issue(
                "all_gather", lambda: all_gather_quantized(self.flat, staged, group=group, tag=tag, bits=bits), tag
            )
        else:
            self.work = self.context.issue(
                "all_gather",
                lambda: comm.all_gather_into_tensor(self.flat, staged, group=group, tag=tag, inline=inline),
                tag,
            )
        self.state = UnitState.GATHERING

    def wait(self) -> None:
        if self.state is UnitState.GATHERING:
            assert self.work is not None
            self.work.wait()
            self.work = None
            self.staged = None
            self.state = UnitState.LIVE

    def gathered(self, exact: bool = False) -> None:
        """Unshard and wait."""
        self.unshard(exact, inline=True)
        self.wait()

    def reshard(self) -> None:
        """Free the gathered storage (waiting for a gather still filling it); the persistent unit stays."""
        if self.kind == "persistent" or self.state is UnitState.FREE:
            return
        self.wait()
        if self.secondary is not None and not self.secondary_current:
            assert self.lanes.secondary is not None
            self.secondary.copy_(self.flat.view(self.lanes.secondary.world, -1)[self.lanes.secondary.rank])
            self.secondary_current = True
        self.context.free(self._empty, tag=f"ZeRO-3 unit {self.index}")
        self._mark(released=True)
        self.state = UnitState.FREE

    def _empty(self) -> None:
        storage = self.full.untyped_storage()
        if self.buffers is None:
            storage.resize_(0)
        else:
            self.buffers.empty(storage)

    def _mark(self, released: bool) -> None:
        for p in self.spec.params:
            if released and type(p) is torch.nn.Parameter:
                p.__class__ = ReleasedParameter
            elif not released and type(p) is ReleasedParameter:
                p.__class__ = torch.nn.Parameter

    def shard_changed(self) -> None:
        """The primary shards hold new weights (a step, a load, a modification): the secondary copy is stale."""
        self.secondary_current = False

    def refresh(self) -> None:
        """Re-gather a live unit after its shard changed (the persistent unit after each step)."""
        self.state = UnitState.FREE
        self.gathered()

    def own_chunk(self) -> torch.Tensor:
        return self.flat.view(self.layout.world, -1)[self.layout.rank]

    def detach(self) -> None:
        """Give every parameter its full value back as an ordinary tensor (the engine is closing)."""
        if self.weight_bits:  # a forward's INT8 values are not the weights
            self.reshard()
        self.gathered(exact=True)
        for p, begin, end in self.ranges():
            p.data = self.full[begin:end].view(p.shape).clone()
        self._empty()
        self.state = UnitState.FREE

    # ------------------------------------------------------------------ passes
    def pre_forward(self) -> None:
        self.depth += 1
        if torch.is_grad_enabled():
            self.pending_backward += 1

    def post_forward(self, keep: bool = False) -> None:
        """``keep``: stay gathered, the backward needs it first (see [Note: the last unit stays])."""
        self.depth -= 1
        if self.depth == 0 and not keep:
            self.reshard()

    def pre_backward(self) -> None:
        self.training_state = TrainingState.PRE_BACKWARD

    def post_backward(self) -> bool:
        """One forward call's backward is done; True when all are (the unit is freed then)."""
        self.pending_backward -= 1
        if self.pending_backward > 0:
            return False
        self.pending_backward = 0
        self.reshard()
        return True

    def idle(self, backward: bool) -> bool:
        """Gathered but needed by no running forward (nor, in ``backward``, by a pending or finished backward)."""
        if self.state is UnitState.FREE or self.depth:
            return False
        return not backward or not (self.pending_backward or self.training_state is TrainingState.POST_BACKWARD)
