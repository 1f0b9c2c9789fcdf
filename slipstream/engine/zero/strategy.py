"""The one interface the engine calls, whatever the ZeRO stage.

[Note: why a strategy object] The engine orchestrates forward/backward/step and never branches on
the stage number: it picks a strategy once and makes the calls listed on ``ShardingStrategy``.
Each strategy owns where gradients, fp32 master weights and optimizer state live and how ranks
synchronize them.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from slipstream.engine.zero.offload.options import OffloadOptions
from slipstream.engine.zero.slices import OwnedSlice
from slipstream.utils.pieces import ParamSlice

OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


@dataclasses.dataclass(frozen=True)
class ShardingOptions:
    """The knobs a strategy needs, copied once out of the config."""

    reduce_bucket_numel: int
    overlap_comm: bool = True
    communication_dtype: torch.dtype | None = None  # None: reduce in the gradient buffer's dtype
    gradient_predivide_factor: float = 1.0
    prescale_gradients: bool = False
    average: bool = True  # False: gradient_allreduce_op "sum"
    group: dist.ProcessGroup | None = None
    offload: OffloadOptions | None = None  # when optimizer state or parameters leave the device


DEFAULT_GROUP: Any = "sharding-options-group"  # ParamGroupSpec.group: shard over ShardingOptions.group


@dataclasses.dataclass(frozen=True)
class ParamGroupSpec:
    """A parameter group as the user gave it: parameters, their optimizer options, their sharding group.

    ``group`` is the process group the group's parameters are sharded over and whose gradients they
    average (key ``"process_group"`` in a user's param-group dict); by default the strategy's
    ``ShardingOptions.group``. [Note: per-group sharding] Each rank passes the group it belongs to,
    so a parameter sharded over {0,1} on ranks 0 and 1 is sharded over {2,3} on ranks 2 and 3: the
    two subgroups hold replicas that stay equal only if each averages a gradient equal to the
    other's. So ranks at the same position of different subgroups must see equivalent data, e.g.
    ranks 0 and 2 micro-batch X and ranks 1 and 3 micro-batch Y: averaging over {0,1} and over all
    four ranks then both give the gradient of X∪Y. Gradients are averaged over each group's own
    size (a mean over {0,1} divides by 2); the global gradient norm counts each parameter once.
    """

    params: list[torch.nn.Parameter]
    options: dict[str, Any]
    group: Any = DEFAULT_GROUP  # dist.ProcessGroup, None (the world) or DEFAULT_GROUP

    def sharding_group(self, default: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
        return default if self.group is DEFAULT_GROUP else self.group

    @staticmethod
    def from_user(groups: Iterable[Any]) -> list[ParamGroupSpec]:
        groups = list(groups)
        if groups and isinstance(groups[0], dict):
            specs = []
            for g in groups:
                options = {k: v for k, v in g.items() if k not in ("params", "process_group")}
                params = g["params"]
                params = [params] if isinstance(params, torch.Tensor) else list(params)
                specs.append(ParamGroupSpec(params, options, g.get("process_group", DEFAULT_GROUP)))
            return specs
        return [ParamGroupSpec(list(groups), {})]


class ShardingStrategy(abc.ABC):
    """Gradient hooks, reduction at the boundary, the optimizer step and the state it owns.

    The calls, in the order of a training step (the engine makes no others):

    * ``begin_backward(sync)`` before each backward, ``end_backward()`` after it, and
      ``finish_gradients()`` after the one that completes an accumulation window;
    * at the boundary ``global_grad_norm()``, then ``scale_gradients(factor)`` (unscale and clip),
      ``step()`` and ``zero_grad()`` (also after a skipped step);
    * ``consolidated_state_dict()`` for full weights, ``close()`` when the engine is discarded.

    The checkpoint code reads and writes the state through ``sharded_state()``,
    ``slice_optimizer_state()``, ``load_slice_optimizer_state()`` and ``load_sharded_state()``;
    ``memory_breakdown()`` is for the memory estimator and tests. ``optimizer`` is what the
    engine, LR schedulers and users see; ``hooks`` are removed by ``close()``.
    """

    optimizer: torch.optim.Optimizer
    hooks: list[torch.utils.hooks.RemovableHandle]
    aside = False  # inside ``set_aside``: the gradient hooks let every accumulation pass

    @abc.abstractmethod
    def begin_backward(self, sync: bool) -> None:
        """Before each backward; ``sync``: this backward completes the gradients (stages 0-2 defer communication otherwise)."""

    def end_backward(self) -> None:
        """After every backward (ZeRO-3 completes its per-pass bookkeeping and reductions here)."""

    @contextlib.contextmanager
    def accumulation_window(self) -> Iterator[None]:
        """Forwards and backwards in any interleaving (a pipeline schedule), reduced once at the end.

        Inside, gradients accumulate locally over every micro-batch (and gradients added to
        ``param.grad`` by hand count too: zero-bubble weight passes); on exit they are handed to
        the reduction, so ``finish_gradients()`` after it completes the window. Stages 0-2 defer
        as in ``no_sync``; stage 3 keeps its units gathered for the whole window (gathered once,
        reduce-scattered once per step, not per micro-batch).
        """
        self.begin_backward(False)
        try:
            yield
        finally:
            self.end_backward()
        self.adopt_gradients()

    @contextlib.contextmanager
    def set_aside(self) -> Iterator[None]:
        """A forward and backward the strategy takes no part in (the first-batch twin check): its gradients
        stay where autograd leaves them (returned by ``torch.autograd.grad``, or accumulated in ``.grad`` by a
        pipeline schedule, which the check restores afterwards), nothing is reduced or adopted. Stages 0-2
        hold their accumulation hooks; ZeRO-3 overrides this to gather its units once and stand aside."""
        self.aside = True
        try:
            yield
        finally:
            self.aside = False

    def adopt_gradients(self) -> None:
        """Take in gradients that reached ``.grad`` without the strategy's hooks (stages 0-2)."""
        for param in getattr(self, "trainable", ()):
            if param.grad is not None:
                self._on_grad(param)  # type: ignore[attr-defined]

    @abc.abstractmethod
    def finish_gradients(self) -> None:
        """Complete every reduction: afterwards the gradients this rank owns are averaged over ranks.

        Called at the end of the boundary backward, so ``.grad`` is final when backward returns.
        """

    @abc.abstractmethod
    def global_grad_norm(self) -> torch.Tensor:
        """L2 norm over all gradients, each parameter counted once (identical on every rank; inf/nan on overflow)."""

    @abc.abstractmethod
    def scale_gradients(self, factor: float | torch.Tensor) -> None:
        """Multiply every gradient this rank owns by ``factor`` (unscaling and clipping; a tensor: a device scalar
        the host never reads, [Note: the step does not wait for the device])."""

    @abc.abstractmethod
    def step(self) -> None:
        """Apply the optimizer and make the updated weights visible in the model's parameters."""

    @abc.abstractmethod
    def zero_grad(self) -> None:
        """Start a new accumulation window: gradients and used-parameter flags cleared."""

    @abc.abstractmethod
    def consolidated_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Full fp32 weights by parameter name on global rank 0 (``None`` elsewhere). Collective."""

    @abc.abstractmethod
    def memory_breakdown(self) -> dict[str, int]:
        """Bytes held between steps: ``params``, ``grads``, ``optimizer`` (state + fp32 masters), ``buffers``."""

    # [Note: checkpoint state] The checkpoint code (engine/checkpoint) saves and loads through these
    # four methods only; what it writes is keyed by parameter name and flat offset, never by rank.
    @abc.abstractmethod
    def sharded_state(self) -> list[OwnedSlice]:
        """This rank's slices of every parameter (fp32 masters where kept), with their optimizer tensors."""

    @abc.abstractmethod
    def slice_optimizer_state(self, owned: OwnedSlice) -> dict[str, Any] | None:
        """The optimizer state of one slice: tensors with the slice's elements, or scalars (``step``)."""

    @abc.abstractmethod
    def load_slice_optimizer_state(self, owned: OwnedSlice, state: dict[str, Any] | None) -> None:
        """Install ``state`` (tensors already shaped and placed like ``owned.optimizer_param``); None clears it."""

    @abc.abstractmethod
    def load_sharded_state(self, read: Callable[[ParamSlice], torch.Tensor]) -> None:
        """Fill every slice this rank holds with ``read(slice)`` (any checkpoint slicing), then show it in the model. Collective."""

    def leave_partitioned(self) -> bool:
        """Close, leaving the parameters partitioned for the model's next engine; False (nothing done) where not possible."""
        return False

    def close(self) -> None:
        """Remove hooks (an engine can be discarded and the model wrapped again)."""
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
