"""ZeRO stage 0: plain data parallelism with bucketed, overlapped gradient all-reduce.

Every rank holds the full model, gradients and optimizer state. Gradients land in one contiguous
fp32 buffer: for fp32 models ``param.grad`` *is* a view into it (autograd accumulates in place, no
copies); for bf16/fp16 models a post-accumulate hook adds the low-precision gradient into the fp32
view and frees it, and fp32 master weights (whose ``.grad`` are the same views) are what the
optimizer updates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from slipstream import comm
from slipstream.comm.context import CommContext
from slipstream.engine.zero.arrivals import ADD_AND_FREE, ADOPT, attach
from slipstream.engine.zero.grad_buckets import BucketedAllReduce
from slipstream.engine.zero.params import (
    TrainableParams,
    bind_optimizer,
    install_slice_state,
    optimizer_state_bytes,
    slice_state,
)
from slipstream.engine.zero.sharding_groups import first_of, model_spread
from slipstream.engine.zero.slices import OwnedSlice, slice_of
from slipstream.engine.zero.strategy import OptimizerFactory, ParamGroupSpec, ShardingOptions, ShardingStrategy
from slipstream.engine.zero.used_flags import UsedFlags
from slipstream.utils.logging import get_logger
from slipstream.utils.pieces import ParamSlice
from slipstream.utils.placement import is_duplicate, placement_of

logger = get_logger(__name__)


class DataParallelStrategy(ShardingStrategy):
    def __init__(
        self,
        module: torch.nn.Module,
        groups: list[ParamGroupSpec],
        options: ShardingOptions,
        optimizer: torch.optim.Optimizer | OptimizerFactory,
    ) -> None:
        self.options = options
        self.group = options.group
        self.module = module
        params = TrainableParams(module, groups)
        self.names, self.trainable, self.index = params.names, params.trainable, params.index
        self.low_precision = any(p.dtype != torch.float32 for p in self.trainable)
        self.group_of = group_of = {id(p): g.sharding_group(self.group) for g in groups for p in g.params}
        self.comm_context = CommContext()  # streams and events of every collective below (comm/context.py)
        self.reducer = BucketedAllReduce(
            self.trainable,
            torch.float32,
            options.reduce_bucket_numel,
            group=self.group,
            communication_dtype=options.communication_dtype,
            predivide_factor=options.gradient_predivide_factor,
            prescale=options.prescale_gradients,
            average=options.average,
            groups=[group_of.get(id(p), self.group) for p in self.trainable],
            context=self.comm_context,
            tail=len(
                self.trainable
            ),  # the used-parameter flags ride the last bucket ([Note: a tail on the last bucket])
        )
        logger.debug("stage 0: %d gradient buckets", len(self.reducer.buckets))
        # collective set-up now, not in a backward hook: all-reduces take the ring's memory
        for group in {id(b.group): b.group for b in self.reducer.buckets}.values():
            comm.ring_context(group)
        if self.low_precision:
            self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.trainable]
        else:
            self.masters = self.trainable
        self.optimizer = bind_optimizer(optimizer, groups, self.index, lambda i: [self.masters[i]])
        self.used = UsedFlags(len(self.trainable), self.reducer.buffer.device)  # [Note: flags on the host]
        self.reducer.fill_tail = self.used.write
        self.spread = model_spread(list(module.parameters()), self.group)
        # [Note: arrivals in C++] (arrivals.py): fp32 gradients stay views of the buffer, bf16/fp16 ones are added
        # into it and freed; every arrival marks its flag and counts its bucket down to the launch.
        launcher = self.reducer.launcher
        self.arrivals = attach(
            self.trainable,
            range(len(self.trainable)),
            self.reducer.views,
            ADD_AND_FREE if self.low_precision else ADOPT,
            [launcher.bucket_of[i] for i in range(len(self.trainable))],
            len(launcher.members),
            self.used.local,
            launcher.complete,
            launcher.twice,
        )
        self.arrivals.launch = options.overlap_comm
        self.hooks = [self.arrivals]
        self.zero_grad()

    # ------------------------------------------------------------------ backward
    def begin_backward(self, sync: bool) -> None:
        self.arrivals.before_backward(sync)

    @property  # type: ignore[override]
    def aside(self) -> bool:
        return self.arrivals.aside

    @aside.setter
    def aside(self, value: bool) -> None:
        self.arrivals.aside = value

    def _on_grad(self, param: torch.Tensor) -> None:
        """A gradient that reached ``.grad`` without autograd's accumulator (adopt_gradients)."""
        self.arrivals.arrive(self.index[id(param)])

    def finish_gradients(self) -> None:
        self.reducer.finish()
        # Parameters no rank used keep grad None, as in plain PyTorch, so the optimizer skips them.
        if self.reducer.tail is not None:  # summed with the last bucket
            used = self.used.read(self.reducer.tail)
        else:
            members: dict[int, tuple[dist.ProcessGroup | None, list[int]]] = {}
            for bucket in self.reducer.buckets:
                members.setdefault(id(bucket.group), (bucket.group, []))[1].extend(bucket.members)
            used = self.used.reduce(list(members.values()) or [(self.group, [])])
        for master, view, got in zip(self.masters, self.reducer.views, used):
            master.grad = view if got else None
        self.arrivals.sync = False

    # ------------------------------------------------------------------ step
    def global_grad_norm(self) -> torch.Tensor:
        # Gradients are replicated after the all-reduce, so the norm needs no collective. Unused
        # parameters' slots are zero and add nothing.
        if not self.spread:
            return torch.linalg.vector_norm(self.reducer.buffer)
        # [Note: the norm of a spread model] (sharding_groups.py): each rank adds what it saves, and
        # one sum over the world counts every element once.
        total = torch.zeros(1, dtype=torch.float32, device=self.reducer.buffer.device)
        for p, view in zip(self.trainable, self.reducer.views):
            if self._saves(p):
                total += torch.linalg.vector_norm(view, dtype=torch.float32) ** 2
        comm.all_reduce(total, tag="gradient norm", inline=True).wait()
        return total.sqrt()[0]

    def scale_gradients(self, factor: float | torch.Tensor) -> None:
        if isinstance(factor, torch.Tensor) or factor != 1.0:
            self.reducer.buffer.mul_(factor)

    def step(self) -> None:
        self.optimizer.step()
        if self.low_precision:
            with torch.no_grad():
                torch._foreach_copy_([p.data for p in self.trainable], self.masters)

    def zero_grad(self) -> None:
        self.reducer.buffer.zero_()
        self.reducer.reset()
        self.arrivals.reset()
        self.used.reset()
        if not self.low_precision:
            for p, view in zip(self.trainable, self.reducer.views):
                p.grad = view

    def consolidated_state_dict(self) -> dict[str, torch.Tensor] | None:
        if dist.get_rank() != 0:  # global rank 0, whatever the groups: it holds everything
            return None
        master_of = {id(p): m for p, m in zip(self.trainable, self.masters)}
        return {name: master_of.get(id(p), p).detach().float().clone() for name, p in self.module.named_parameters()}

    def sharded_state(self) -> list[OwnedSlice]:
        # Every rank of the group holds everything: all slices are whole parameters (whole pieces,
        # under tensor/pipeline/expert parallel), replicated; the group's first rank saves them.
        master_of = {id(p): m for p, m in zip(self.trainable, self.masters)}
        owned = []
        for name, p in self.module.named_parameters():
            master = master_of.get(id(p))
            value = (master if master is not None else p).detach().view(-1)
            owned.append(OwnedSlice(slice_of(name, p), value, master, replicated=True, duplicate=not self._saves(p)))
        return owned

    def _saves(self, param: torch.Tensor) -> bool:
        """Whether this rank saves ``param`` (and counts it in a spread model's norm).

        Every rank of a parameter's group holds it whole. An unplaced parameter is saved by the
        default group's first rank, as before any parallelism (its subgroups' replicas are equal); a
        placed piece by the first rank of its own group, unless it is a duplicate.
        """
        if placement_of(param) is None:
            return first_of(self.group)
        return not is_duplicate(param) and first_of(self.group_of.get(id(param), self.group))

    def slice_optimizer_state(self, owned: OwnedSlice) -> dict[str, Any] | None:
        return slice_state(self.optimizer, owned.optimizer_param)

    def load_slice_optimizer_state(self, owned: OwnedSlice, state: dict[str, Any] | None) -> None:
        install_slice_state(self.optimizer, owned.optimizer_param, state)

    def load_sharded_state(self, read: Callable[[ParamSlice], torch.Tensor]) -> None:
        with torch.no_grad():
            for owned in self.sharded_state():
                owned.value.copy_(read(owned.slice).reshape(-1))
            if self.low_precision:
                torch._foreach_copy_([p.data for p in self.trainable], self.masters)

    def memory_breakdown(self) -> dict[str, int]:
        masters = sum(m.numel() * 4 for m in self.masters) if self.low_precision else 0
        return {
            "params": sum(p.numel() * p.element_size() for p in self.trainable),
            "grads": self.reducer.buffer.numel() * self.reducer.buffer.element_size(),
            "optimizer": optimizer_state_bytes(self.optimizer) + masters,
            "buffers": 0,
        }
