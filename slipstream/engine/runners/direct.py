"""The direct step runner: each ``engine(batch)`` runs the model, each ``engine.backward`` its backward.

Data, tensor and expert parallelism need nothing more; with Ulysses or ring attention the batch is
sharded on the sequence first and the whole sequence's loss comes out (``parallel/sequence``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from slipstream.engine.monitor import TrainingMonitor
from slipstream.engine.parallel.calls import call_model, loss_of, router_loss_of
from slipstream.engine.parallel.compiling import CompiledBlocks
from slipstream.engine.parallel.sequence import Sharder
from slipstream.engine.runners.base import cast_floats
from slipstream.engine.zero.strategy import ShardingStrategy


class DirectRunner:
    def __init__(
        self,
        module: torch.nn.Module,
        strategy: ShardingStrategy,
        monitor: TrainingMonitor,
        sharder: Sharder | None,
        cast_dtype: torch.dtype | None,
        compiled: Callable[[], CompiledBlocks | None] = lambda: None,
    ) -> None:
        """``cast_dtype``: floating-point inputs are cast to it (``auto_cast``); ``sharder``: Ulysses / ring attention;
        ``compiled``: the compiled blocks now (``engine.compile`` replaces them), whose context each backward runs in."""
        self.module, self.strategy, self.monitor, self.sharder, self.cast_dtype = (
            module,
            strategy,
            monitor,
            sharder,
            cast_dtype,
        )
        self.compiled = compiled

    def forward(self, args: tuple[Any, ...], kwargs: dict[str, Any], step: int) -> Any:
        if self.cast_dtype is not None:
            args, kwargs = cast_floats((args, kwargs), self.cast_dtype)
        with self.monitor.forward(args, kwargs, step):
            output = (
                self.module(*args, **kwargs)
                if self.sharder is None
                else self._forward_sharded(self.sharder, args, kwargs)
            )
        router = router_loss_of(output) if torch.is_grad_enabled() else None
        if router is not None:
            self.monitor.on_router_loss(router)
        return output

    def _forward_sharded(self, sharder: Sharder, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """This rank's share of the sequence through the model, the whole sequence's loss out (parallel/sequence/inputs.py)."""
        if args:
            raise TypeError(
                f"engine(...): with {sharder.key} > 1 pass the batch as keyword arguments (input_ids=..., labels=...)"
            )
        check = sharder.take_first_batch_check() if torch.is_grad_enabled() else None
        if check is not None:  # the first training batch, before it trains (parallel/sequence/first_batch.py)
            with self.strategy.set_aside():
                check(kwargs)
        # A forward without gradients between a training forward and its backward (TRL's metrics forward) must
        # leave that backward's sharded attention and segments in place: its recomputation (activation
        # checkpointing) runs the same kernels on the same structure.
        pending = sharder.current if sharder.active else None
        was_active = sharder.active
        local, count = sharder.shard(kwargs)
        sharder.activate()  # the model's own attention again after this step (parallel/attention.py)
        try:
            return sharder.combine(self.module(**local), count)
        except BaseException:
            sharder.deactivate()
            raise
        finally:
            if not torch.is_grad_enabled():  # no backward follows this forward
                if was_active:
                    sharder.resume(pending)
                else:
                    sharder.deactivate()

    def backward(
        self, loss: Any, loss_scale: float, accumulation: int, boundary: bool, retain_graph: bool, step: int
    ) -> None:
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(
                f"engine.backward: expected the scalar loss tensor, got {type(loss).__name__}"
                + (f" with shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
                + " (for a ModelOutput pass output.loss)"
            )
        compiled = self.compiled()
        # compiled autograd (compile.compiled_autograd) is on before the strategy prepares its hooks for it
        with compiled.backward() if compiled is not None else contextlib.nullcontext():
            self.strategy.begin_backward(boundary)
            with self.monitor.timers("backward"):
                try:
                    scale = loss_scale / accumulation  # a product with 1.0 is the loss itself: no node for it
                    (loss.float() if scale == 1.0 else loss.float() * scale).backward(retain_graph=retain_graph)
                finally:
                    if self.sharder is not None and not retain_graph:
                        self.sharder.deactivate()
        with self.monitor.timers("reduce"):
            self.strategy.end_backward()
            if boundary:  # like DDP: when backward returns, .grad holds the averaged gradients
                self.strategy.finish_gradients()
        self.monitor.on_loss(loss.detach(), step)

    def loss_of(self, output: Any) -> torch.Tensor:
        return loss_of(output)

    def evaluate(self, batches: list[Any], step: int) -> list[float]:
        def model(*args: Any, **kwargs: Any) -> Any:
            return self.forward(args, kwargs, step)

        with torch.no_grad():
            return [float(loss_of(call_model(model, b)).detach()) for b in batches]  # type: ignore[arg-type]
