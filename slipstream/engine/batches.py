"""The user's loop under a pipeline, and DeepSpeed's ``train_batch``/``eval_batch`` on any mesh.

[Note: the loop under a pipeline] A pipeline runs all micro-batches of a window together, so
``loss = engine(batch)`` cannot compute the loss yet: it records the micro-batch and returns a
:class:`DeferredLoss`. ``engine.backward(loss)`` on the window's last micro-batch runs the
schedule (inside the ZeRO strategy's accumulation window) and fills in every deferred loss of
the window, on every rank; ``engine.step()`` then steps as usual. Reading a loss earlier is an
error that says when it becomes available.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from slipstream import comm
from slipstream.engine.parallel.calls import call_model, loss_of

Engine = Any  # the Engine calls in here (it imports this module, so this module cannot import it)


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
    def ready(self) -> bool:
        return self._value is not None

    def item(self) -> float:
        if self._value is None:
            raise RuntimeError(
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


def as_batch(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if args and kwargs:
        raise TypeError("engine(...): under a pipeline pass a micro-batch either as keyword arguments or as positional ones, not both")
    if kwargs:
        return kwargs
    return args[0] if len(args) == 1 else args


def collect(engine: Engine, args: tuple[Any, ...], kwargs: dict[str, Any]) -> DeferredLoss:
    """``engine(batch)`` under a pipeline: keep the micro-batch for the window's schedule."""
    pending = engine.pipeline_window
    if len(pending) >= engine.gradient_accumulation_steps():
        raise RuntimeError(
            f"engine(...): already {len(pending)} micro-batches in this window (gradient_accumulation_steps); call "
            "engine.backward() and engine.step() after each forward"
        )
    loss = DeferredLoss(len(pending), engine.global_steps)
    pending.append((as_batch(args, kwargs), loss))
    return loss


def backward(engine: Engine, loss: Any, boundary: bool) -> None:
    """``engine.backward`` under a pipeline: nothing until the window's last micro-batch, then the schedule."""
    if not isinstance(loss, DeferredLoss):
        raise TypeError(f"engine.backward: under a pipeline pass the loss engine(batch) returned, got {type(loss).__name__}")
    if not boundary:
        return
    pending, engine.pipeline_window = engine.pipeline_window, []
    if len(pending) != engine.gradient_accumulation_steps():
        raise RuntimeError(
            f"engine.backward: the window holds {len(pending)} micro-batches but gradient_accumulation_steps is "
            f"{engine.gradient_accumulation_steps()}; a pipeline step needs them all"
        )
    scale = engine.loss_scaler.scale / engine.gradient_accumulation_steps()
    report = engine.pipeline.train_step([b for b, _ in pending], scale, engine.strategy.accumulation_window)
    engine.strategy.finish_gradients()
    for (_, deferred), value in zip(pending, report.losses):
        deferred._resolve(value)
        engine.monitor.on_loss(torch.tensor(value), engine.global_steps)
    engine.monitor.on_pipeline_step(report.timing.bubble if report.timing else None, report.predicted_bubble, engine.global_steps)


def train_batch(engine: Engine, data_iter: Iterator[Any] | Iterable[Any] | None) -> torch.Tensor:
    """DeepSpeed's ``train_batch``: ``gradient_accumulation_steps`` micro-batches, one optimizer step, the mean loss."""
    it = _iterator(engine, data_iter)
    # The window's micro-batches are drawn before any runs: an iterator that ends inside the window raises
    # StopIteration with nothing recorded (DeepSpeed's epoch idiom, `except StopIteration: it = iter(loader)`,
    # then starts a clean window; no stale micro-batch leaks into the next step).
    batches = _draw(it, engine.gradient_accumulation_steps(), "train_batch")
    losses = []
    for batch in batches:
        loss = engine(**batch) if isinstance(batch, dict) else engine(*batch) if isinstance(batch, (tuple, list)) else engine(batch)
        if engine.pipeline is None:
            loss = loss_of(loss)
        engine.backward(loss)
        engine.step()
        losses.append(loss)  # a pipeline's are known after the window's last backward
    return _mean_over_dp(engine, [float(loss.item()) if isinstance(loss, DeferredLoss) else float(loss.detach()) for loss in losses])


def eval_batch(engine: Engine, data_iter: Iterator[Any] | Iterable[Any] | None) -> torch.Tensor:
    """DeepSpeed's ``eval_batch``: forward only over ``gradient_accumulation_steps`` micro-batches, the mean loss."""
    it = _iterator(engine, data_iter)
    batches = _draw(it, engine.gradient_accumulation_steps(), "eval_batch")
    if engine.pipeline is not None:
        return _mean_over_dp(engine, engine.pipeline.evaluate(batches))
    with torch.no_grad():
        losses = [float(loss_of(call_model(engine, b)).detach()) for b in batches]
    return _mean_over_dp(engine, losses)


def _draw(it: Iterator[Any], count: int, call: str) -> list[Any]:
    drawn: list[Any] = []
    for _ in range(count):
        try:
            drawn.append(next(it))
        except StopIteration:
            raise StopIteration(
                f"{call}: the data iterator ended after {len(drawn)} of the window's {count} micro-batches "
                "(gradient_accumulation_steps); they were dropped and no step was taken"
            ) from None
    return drawn


def _iterator(engine: Engine, data_iter: Any) -> Iterator[Any]:
    if data_iter is None:
        if engine.training_dataloader is None:
            raise ValueError("train_batch/eval_batch: pass data_iter, or give initialize(training_data=...)")
        if engine.data_iterator is None:
            engine.data_iterator = iter(engine.training_dataloader)
        return engine.data_iterator
    return data_iter if isinstance(data_iter, Iterator) else iter(data_iter)


def _mean_over_dp(engine: Engine, losses: list[float]) -> torch.Tensor:
    mean = torch.tensor([sum(losses) / len(losses)], dtype=torch.float64)
    if engine.mesh is not None and engine.mesh.size("dp") > 1:
        comm.all_reduce(mean, group=engine.mesh.group("dp"), tag="train_batch mean loss").wait()
        mean /= engine.mesh.size("dp")
    return mean[0].float()
