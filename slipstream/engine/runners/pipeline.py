"""The pipeline step runner: the user's loop, unchanged, drives a schedule that runs a whole window at once.

[Note: the loop under a pipeline] A pipeline runs all micro-batches of a window together, so
``loss = engine(batch)`` cannot compute the loss yet: it records the micro-batch and returns a
:class:`DeferredLoss`. ``engine.backward(loss)`` on the window's last micro-batch runs the
schedule (inside the ZeRO strategy's accumulation window) and fills in every deferred loss of
the window, on every rank; ``engine.step()`` then steps as usual. Reading a loss earlier is an
error that says when it becomes available.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from slipstream.engine.monitor import TrainingMonitor
from slipstream.engine.parallel.pipeline import Pipeline
from slipstream.engine.parallel.sequence import Sharder
from slipstream.engine.runners.base import cast_floats
from slipstream.engine.zero.strategy import ShardingStrategy
from slipstream.errors import UsageError


class DeferredLoss:
    """A micro-batch's loss under a pipeline: known once the window's last ``engine.backward`` ran."""

    def __init__(self, micro: int, step: int) -> None:
        self.micro, self.step = micro, step
        self._value: float | None = None

    def _resolve(self, value: float) -> None:
        self._value = value

    @property
    def loss(self) -> DeferredLoss:
        """``engine(**batch).loss`` keeps working: the model's output is the loss under a pipeline."""
        return self

    @property
    def logits(self) -> Any:
        """Refused in one line: a pipeline's logits live on its last stage, inside the schedule."""
        raise UsageError(
            "pipeline: engine(batch) returns the micro-batch's loss, not the model's output; the logits exist only on the "
            "last stage inside the schedule. Compute a logits-based loss in the model's forward (return it as .loss), or "
            "train without pipeline.stages"
        )

    @property
    def ready(self) -> bool:
        return self._value is not None

    def item(self) -> float:
        if self._value is None:
            raise UsageError(
                f"pipeline: the loss of micro-batch {self.micro} of step {self.step} is computed when the accumulation "
                "window's last engine.backward() runs the pipeline schedule; read it after that call"
            )
        return self._value

    def __float__(self) -> float:
        return self.item()

    def detach(self) -> torch.Tensor:
        return torch.tensor(self.item())

    def numel(self) -> int:
        return 1

    def __repr__(self) -> str:
        return f"DeferredLoss(micro={self.micro}, step={self.step}, value={self._value})"

    def _arithmetic(self, *_: Any) -> Any:
        raise UsageError(
            "pipeline: the loss engine(batch) returns is computed inside the schedule, so arithmetic on it (loss * x, "
            "loss + aux) cannot be back-propagated; compute the whole loss in the model's forward (return it as .loss) "
            "and pass engine.backward the loss engine(batch) returned"
        )

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = __neg__ = _arithmetic


def as_batch(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if args and kwargs:
        raise TypeError(
            "engine(...): under a pipeline pass a micro-batch either as keyword arguments or as positional ones, not both"
        )
    if kwargs:
        return kwargs
    return args[0] if len(args) == 1 else args


class PipelineRunner:
    """``sharder``: Ulysses / ring attention inside the stages. Each micro-batch is cut on the sequence when it
    is recorded; the window's schedule runs with the sharded attention switched on, and the last stage's loss
    is the whole sequence's (the sharder's combine)."""

    def __init__(
        self,
        pipeline: Pipeline,
        strategy: ShardingStrategy,
        monitor: TrainingMonitor,
        cast_dtype: torch.dtype | None,
        sharder: Sharder | None = None,
    ) -> None:
        self.pipeline, self.strategy, self.monitor, self.cast_dtype, self.sharder = (
            pipeline,
            strategy,
            monitor,
            cast_dtype,
            sharder,
        )
        # This window's micro-batches, each with its labelled tokens on this rank (under a sharder) and its deferred loss.
        self.window: list[tuple[Any, torch.Tensor | None, DeferredLoss]] = []
        self.divisors: list[int] = []  # per micro-batch of the window: what engine.backward divides its loss by

    def forward(self, args: tuple[Any, ...], kwargs: dict[str, Any], step: int) -> DeferredLoss:
        """``engine(batch)``: keep the micro-batch for the window's schedule."""
        if self.cast_dtype is not None:
            args, kwargs = cast_floats((args, kwargs), self.cast_dtype)
        if len(self.window) >= self.pipeline.micro_batches:
            raise UsageError(
                f"engine(...): already {len(self.window)} micro-batches in this window (gradient_accumulation_steps); call "
                "engine.backward() and engine.step() after each forward"
            )
        batch, count = as_batch(args, kwargs), None
        self.pipeline.check_batch(batch)
        if self.sharder is not None:
            check = (
                self.sharder.take_first_batch_check() if torch.is_grad_enabled() and isinstance(batch, dict) else None
            )
            if check is not None:  # the first training micro-batch, before it trains (parallel/sequence/first_batch.py)
                with self.strategy.set_aside():
                    check(batch)
            batch, count = self._shard(batch)
        loss = DeferredLoss(len(self.window), step)
        self.window.append((batch, count, loss))
        return loss

    def backward(
        self, loss: Any, loss_scale: float, accumulation: int, boundary: bool, retain_graph: bool, step: int
    ) -> None:
        """Nothing until the window's last micro-batch, then the schedule.

        Each micro-batch's loss is divided by ``accumulation`` as the direct runner divides it: the window's size
        by default, 1 under ``engine.backward(loss, scale_wrt_gas=False)`` (the Hugging Face Trainer's
        ``num_items_in_batch`` style, where the model's loss is already normalised over the window).
        """
        if not isinstance(loss, DeferredLoss):
            raise TypeError(
                f"engine.backward: under a pipeline pass the loss engine(batch) returned, got {type(loss).__name__}"
            )
        self.divisors.append(accumulation)
        if not boundary:
            return
        pending, self.window = self.window, []
        divisors, self.divisors = self.divisors, []
        m = self.pipeline.micro_batches
        if len(pending) != m:
            raise UsageError(
                f"engine.backward: the window holds {len(pending)} micro-batches but gradient_accumulation_steps is {m}; a "
                "pipeline step needs them all"
            )
        if len(set(divisors)) != 1:
            raise UsageError(
                "engine.backward: under a pipeline every micro-batch of a window must be scaled alike (scale_wrt_gas was "
                f"{[d != 1 or m == 1 for d in divisors]} across the window): the schedule runs them together"
            )
        with self.monitor.timers("backward"), self._sharded():
            report = self.pipeline.train_step(
                [b for b, _, _ in pending],
                loss_scale / divisors[0],
                self.strategy.accumulation_window,
                self._finish([c for _, c, _ in pending]),
            )
            self.strategy.finish_gradients()
        for (_, _, deferred), value in zip(pending, report.losses):
            deferred._resolve(value)
            self.monitor.on_loss(torch.tensor(value), step)
        for router in report.router_losses or ():
            if not math.isnan(router):
                self.monitor.on_router_loss(torch.tensor(router))
        timing = report.timing
        overlapped = timing.overlapped if timing is not None and self.pipeline.schedule.pairs else None
        self.monitor.on_pipeline_step(timing.bubble if timing else None, report.predicted_bubble, step, overlapped)

    def loss_of(self, output: Any) -> DeferredLoss:
        return output  # type: ignore[no-any-return]

    def evaluate(self, batches: list[Any], step: int) -> list[float]:
        if self.sharder is None:
            return self.pipeline.evaluate(batches)
        local = [self._shard(b) for b in batches]
        with self._sharded():
            return self.pipeline.evaluate([b for b, _ in local], self._finish([c for _, c in local]))

    def _shard(self, batch: Any) -> tuple[dict[str, Any], torch.Tensor | None]:
        assert self.sharder is not None
        if not isinstance(batch, dict):
            raise TypeError(
                f"engine(...): with {self.sharder.key} > 1 pass the batch as keyword arguments (input_ids=..., labels=...)"
            )
        return self.sharder.shard(batch)

    def _finish(self, counts: list[torch.Tensor | None]) -> Callable[[Any, int], Any] | None:
        sharder = self.sharder
        if sharder is None:
            return None
        return lambda output, micro: sharder.combine(output, counts[micro])

    @contextlib.contextmanager
    def _sharded(self) -> Iterator[None]:
        """The sharded attention on for the schedule (the model's own again after it, even on an error)."""
        if self.sharder is None:
            yield
            return
        self.sharder.activate()
        try:
            yield
        finally:
            self.sharder.deactivate()
