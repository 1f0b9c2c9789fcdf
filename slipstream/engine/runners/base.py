"""What every step runner shares: the interface the Engine calls, and the window helpers of ``train_batch``/``eval_batch``.

[Note: a step runner] The Engine keeps the loop's state (counters, boundaries, loss scale, the
optimizer step) and hands each micro-batch to one runner, chosen once at ``initialize``:
:class:`~slipstream.engine.runners.direct.DirectRunner` runs forward and backward as the user calls
them, :class:`~slipstream.engine.runners.pipeline.PipelineRunner` records micro-batches and runs the
schedule at the window's last backward. The Engine branches on neither; nothing here holds it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import torch

from slipstream import comm
from slipstream.engine.parallel.mesh import Mesh


class StepRunner(Protocol):
    """forward / backward / evaluate of one mode (direct or pipeline)."""

    def forward(self, args: tuple[Any, ...], kwargs: dict[str, Any], step: int) -> Any:
        """``engine(...)``: the model's output, or a stand-in for a loss known later."""
        ...

    def backward(
        self, loss: Any, loss_scale: float, accumulation: int, boundary: bool, retain_graph: bool, step: int
    ) -> None:
        """``engine.backward``: gradients of ``loss · loss_scale / accumulation``, reduced at a ``boundary``."""
        ...

    def loss_of(self, output: Any) -> Any:
        """The loss ``engine.backward`` takes, from what ``forward`` returned (``train_batch``)."""
        ...

    def evaluate(self, batches: list[Any], step: int) -> list[float]:
        """Forward only over a window's micro-batches: each one's loss, the same on every rank that computes it."""
        ...


class Windows:
    """Where ``train_batch``/``eval_batch`` draw a window: the ``data_iter`` given, else one iterator over the
    engine's ``training_dataloader``, kept across calls."""

    def __init__(self, loader: Iterable[Any] | None, count: int) -> None:
        self.loader, self.count = loader, count
        self.iterator: Iterator[Any] | None = None

    def draw(self, data_iter: Any, call: str) -> list[Any]:
        if data_iter is None:
            if self.loader is None:
                raise ValueError("train_batch/eval_batch: pass data_iter, or give initialize(training_data=...)")
            if self.iterator is None:
                self.iterator = iter(self.loader)
            data_iter = self.iterator
        return draw(data_iter if isinstance(data_iter, Iterator) else iter(data_iter), self.count, call)


def draw(it: Iterator[Any], count: int, call: str) -> list[Any]:
    """A window's ``count`` micro-batches, drawn before any runs.

    An iterator that ends inside the window raises StopIteration with nothing recorded (DeepSpeed's
    epoch idiom, ``except StopIteration: it = iter(loader)``, then starts a clean window; no stale
    micro-batch leaks into the next step).
    """
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


def mean_over_dp(losses: list[float], mesh: Mesh) -> torch.Tensor:
    """The mean of ``losses`` over the data-parallel ranks (each saw other batches; the other axes saw the same)."""
    mean = torch.tensor([sum(losses) / len(losses)], dtype=torch.float64)
    if mesh.size("dp") > 1:
        comm.all_reduce(mean, group=mesh.group("dp"), tag="train_batch mean loss", inline=True).wait()
        mean /= mesh.size("dp")
    return mean[0].float()


def cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """Floating-point tensors in ``value`` (nested tuples, lists, dicts) cast to ``dtype`` (``auto_cast``)."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: cast_floats(v, dtype) for k, v in value.items()}
    return value
