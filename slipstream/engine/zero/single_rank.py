"""Every ZeRO stage on a world of one process: the plain PyTorch step, with the stage's memory.

[Note: a world of one shards nothing] Partitioning over one rank keeps the whole of every state
on that rank: a stage-1 shard of the optimizer state, a stage-2 shard of the gradients and a
stage-3 shard of the parameters are each the whole. What stays of a stage's machinery is its
host work — gradient hooks per parameter, reductions over a group of one, gathers and releases
per unit — and that is the whole step of a small model on one device (issue 50: 1.3-1.7× the
plain model's step at 10 tensors). So on one process, without offload, every stage runs this
strategy, which does what a plain PyTorch loop does:

* fp32: gradients are where autograd leaves them (``None`` after ``zero_grad``, so autograd
  hands over its own tensor, no copy, no hook); the norm and the clipping are torch's multi-tensor
  ops over them, and a parameter that got no gradient keeps ``None`` and is skipped by the
  optimizer, exactly as in plain PyTorch.
* bf16/fp16: fp32 master weights, and one hook per parameter that adds its low-precision
  gradient into an fp32 buffer and frees it at once, so no more than one low-precision gradient
  is alive at a time (the memory of every stage), and accumulation runs in fp32.

Memory per process is what every stage holds on one rank (the formula's 16Ψ, or 4Ψ + 2Ψ + 12Ψ in
mixed precision; the estimator's stage numbers at world 1). Offloaded state keeps its stage's
strategy (it moves memory off the device, which a world of one still wants), and so does a model
built under ``zero.Init`` (its parameters live in the shards until stage 3 gathers them).
``zero_optimization.partition_single_rank: true`` keeps every stage's own machinery at one process
(its tests run it so).

What changes against the stage's own run is float noise: the norm is summed over per-tensor norms
(as ``clip_grad_norm_`` sums it) rather than over one flat buffer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from slipstream.engine.zero.arrivals import ADD_AND_FREE, attach
from slipstream.engine.zero.data_parallel import DataParallelStrategy
from slipstream.engine.zero.params import TrainableParams, bind_optimizer, optimizer_state_bytes, single_dtype
from slipstream.engine.zero.stage3.gathered import MasterCopies
from slipstream.engine.zero.strategy import OptimizerFactory, ParamGroupSpec, ShardingOptions


class SingleRankStrategy(DataParallelStrategy):
    """Stage 0's state on one process, without its reducer: see [Note: a world of one shards nothing]."""

    def __init__(
        self,
        module: torch.nn.Module,
        groups: list[ParamGroupSpec],
        options: ShardingOptions,
        optimizer: torch.optim.Optimizer | OptimizerFactory,
        stage: int,
    ) -> None:
        """``stage``: the config's, whose rules the model must follow as at any world size (one dtype from stage 1)."""
        assert dist.get_world_size() == 1, "SingleRankStrategy: a world of one process"
        self.options, self.group, self.module = options, options.group, module
        params = TrainableParams(module, groups)
        self.names, self.trainable, self.index = params.names, params.trainable, params.index
        if stage > 0:
            single_dtype(self.trainable, stage)
        self.low_precision = any(p.dtype != torch.float32 for p in self.trainable)
        self.group_of: dict[int, dist.ProcessGroup | None] = {}
        self.spread = False
        self.gathered: MasterCopies | None = None
        self.used = bytearray(len(self.trainable))
        if self.low_precision:
            device = self.trainable[0].device
            self.grad_buffer = torch.zeros(sum(p.numel() for p in self.trainable), device=device)
            self.views = _views(self.grad_buffer, self.trainable)
            self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.trainable]
            # GatheredParameters(modifier_rank=...) changes the low-precision weights: the masters take them
            self.gathered = MasterCopies(self.trainable, self._masters_from_params)
            self.gathered.register()
        else:
            self.views, self.masters = [], self.trainable
        # bf16/fp16: each gradient is added into fp32 and freed as it arrives; fp32: nothing to hook (no buckets)
        hooked = self.trainable if self.low_precision else []
        self.arrivals = attach(
            hooked, range(len(hooked)), self.views, ADD_AND_FREE, [-1] * len(hooked), 0, self.used, _never, _never
        )
        self.hooks = [self.arrivals]
        self.optimizer = bind_optimizer(optimizer, groups, self.index, lambda i: [self.masters[i]])
        self.zero_grad()

    # ------------------------------------------------------------------ backward
    def begin_backward(self, sync: bool) -> None:
        """Nothing to launch: a gradient may arrive any number of times, as in plain PyTorch (never ``sync``)."""
        self.arrivals.before_backward(False)

    def adopt_gradients(self) -> None:
        if self.low_precision:  # fp32 gradients already are where the step reads them
            super().adopt_gradients()

    def finish_gradients(self) -> None:
        if self.low_precision:
            for master, view, got in zip(self.masters, self.views, self.used):
                master.grad = view if got else None

    # ------------------------------------------------------------------ step
    def _grads(self) -> list[torch.Tensor]:
        return [m.grad for m in self.masters if m.grad is not None]

    def global_grad_norm(self) -> torch.Tensor:
        if self.low_precision:  # one buffer; unused parameters' slots are zero
            return torch.linalg.vector_norm(self.grad_buffer)
        grads = self._grads()
        if not grads:
            return torch.zeros((), device=self.trainable[0].device if self.trainable else None)
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))

    def scale_gradients(self, factor: float | torch.Tensor) -> None:
        if isinstance(factor, torch.Tensor) or factor != 1.0:
            if self.low_precision:
                self.grad_buffer.mul_(factor)
            else:
                torch._foreach_mul_(self._grads(), factor)

    def zero_grad(self) -> None:
        for master in self.masters:
            master.grad = None
        if self.low_precision:
            self.grad_buffer.zero_()
            self.used[:] = bytes(len(self.used))

    def _masters_from_params(self, indices: list[int]) -> None:
        with torch.no_grad():
            for i in indices:
                self.masters[i].copy_(self.trainable[i])

    def memory_breakdown(self) -> dict[str, int]:
        masters = sum(m.numel() * 4 for m in self.masters) if self.low_precision else 0
        return {
            "params": sum(p.numel() * p.element_size() for p in self.trainable),
            "grads": sum(p.numel() * 4 for p in self.trainable),  # fp32: autograd's own, at the step
            "optimizer": optimizer_state_bytes(self.optimizer) + masters,
            "buffers": 0,
        }

    def close(self) -> None:
        super().close()
        if self.gathered is not None:
            self.gathered.unregister()


def _never(_: int) -> None:
    raise AssertionError("single rank: no bucket to launch, no window to check")


def _views(buffer: torch.Tensor, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """``params``' shapes, end to end in ``buffer``."""
    views, offset = [], 0
    for p in params:
        views.append(buffer[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    return views
