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

from slipstream.engine.zero.grad_buckets import BucketedAllReduce
from slipstream.engine.zero.params import (
    TrainableParams,
    adopt_grad,
    bind_optimizer,
    install_slice_state,
    optimizer_state_bytes,
    slice_state,
)
from slipstream.engine.zero.sharding_groups import reduce_flags
from slipstream.engine.zero.slices import OwnedSlice, ParamSlice
from slipstream.engine.zero.strategy import OptimizerFactory, ParamGroupSpec, ShardingOptions, ShardingStrategy
from slipstream.utils.logging import get_logger

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
        params = TrainableParams(module, groups, self.group)
        self.names, self.trainable, self.index = params.names, params.trainable, params.index
        self.low_precision = any(p.dtype != torch.float32 for p in self.trainable)
        group_of = {id(p): g.sharding_group(self.group) for g in groups for p in g.params}
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
        )
        logger.debug("stage 0: %d gradient buckets", len(self.reducer.buckets))
        if self.low_precision:
            self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.trainable]
        else:
            self.masters = self.trainable
        self.optimizer = bind_optimizer(optimizer, groups, self.index, lambda i: [self.masters[i]])
        self.used = torch.zeros(len(self.trainable), dtype=torch.float32, device=self.reducer.buffer.device)
        self.sync = False
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.trainable]
        self.zero_grad()

    # ------------------------------------------------------------------ backward
    def begin_backward(self, sync: bool) -> None:
        self.sync = sync

    def _on_grad(self, param: torch.Tensor) -> None:
        i = self.index[id(param)]
        view = self.reducer.views[i]
        if self.low_precision:
            view.add_(param.grad)
            param.grad = None
        else:
            adopt_grad(param, view)
        self.used[i] = 1.0
        if self.sync:
            self.reducer.mark_ready(i, launch=self.options.overlap_comm)

    def finish_gradients(self) -> None:
        self.reducer.finish()
        # Parameters no rank used keep grad None, as in plain PyTorch, so the optimizer skips them.
        members: dict[int, tuple[dist.ProcessGroup | None, list[int]]] = {}
        for bucket in self.reducer.buckets:
            members.setdefault(id(bucket.group), (bucket.group, []))[1].extend(bucket.members)
        reduce_flags(self.used, list(members.values()) or [(self.group, [])])
        for i, master in enumerate(self.masters):
            master.grad = self.reducer.views[i] if self.used[i] else None
        self.sync = False

    # ------------------------------------------------------------------ step
    def global_grad_norm(self) -> torch.Tensor:
        # Gradients are replicated after the all-reduce, so the norm needs no collective. Unused
        # parameters' slots are zero and add nothing.
        return torch.linalg.vector_norm(self.reducer.buffer)

    def scale_gradients(self, factor: float) -> None:
        if factor != 1.0:
            self.reducer.buffer.mul_(factor)

    def step(self) -> None:
        self.optimizer.step()
        if self.low_precision:
            with torch.no_grad():
                torch._foreach_copy_([p.data for p in self.trainable], self.masters)

    def zero_grad(self) -> None:
        self.reducer.buffer.zero_()
        self.reducer.reset()
        self.used.zero_()
        if not self.low_precision:
            for p, view in zip(self.trainable, self.reducer.views):
                p.grad = view

    def consolidated_state_dict(self) -> dict[str, torch.Tensor] | None:
        if dist.get_rank() != 0:  # global rank 0, whatever the groups: it holds everything
            return None
        master_of = {id(p): m for p, m in zip(self.trainable, self.masters)}
        return {
            name: master_of.get(id(p), p).detach().float().clone() for name, p in self.module.named_parameters()
        }

    def sharded_state(self) -> list[OwnedSlice]:
        # Every rank holds everything: all slices are whole parameters, replicated.
        master_of = {id(p): m for p, m in zip(self.trainable, self.masters)}
        owned = []
        for name, p in self.module.named_parameters():
            master = master_of.get(id(p))
            value = (master if master is not None else p).detach().view(-1)
            owned.append(OwnedSlice(ParamSlice(name, tuple(p.shape), 0, p.numel()), value, master, replicated=True))
        return owned

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
