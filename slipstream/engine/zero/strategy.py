"""The one interface the engine calls, whatever the ZeRO stage.

[Note: why a strategy object] The engine orchestrates forward/backward/step and never branches on
the stage number: it picks a strategy once and calls the same six methods. Each strategy owns where
gradients, fp32 master weights and optimizer state live and how ranks synchronize them.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from slipstream.engine.zero.slices import OwnedSlice, ParamSlice

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
    offload: Any = None  # OffloadOptions (zero/offload/options.py) when optimizer state or parameters leave the device


@dataclasses.dataclass(frozen=True)
class ParamGroupSpec:
    """A parameter group as the user gave it: parameters plus their optimizer options."""

    params: list[torch.nn.Parameter]
    options: dict[str, Any]

    @staticmethod
    def from_user(groups: Iterable[Any]) -> list[ParamGroupSpec]:
        groups = list(groups)
        if groups and isinstance(groups[0], dict):
            specs = []
            for g in groups:
                options = {k: v for k, v in g.items() if k != "params"}
                params = g["params"]
                params = [params] if isinstance(params, torch.Tensor) else list(params)
                specs.append(ParamGroupSpec(params, options))
            return specs
        return [ParamGroupSpec(list(groups), {})]


class ShardingStrategy(abc.ABC):
    """Gradient hooks, reduction at the boundary, the optimizer step and the state it owns."""

    optimizer: torch.optim.Optimizer
    hooks: list[torch.utils.hooks.RemovableHandle]

    @abc.abstractmethod
    def begin_backward(self, sync: bool) -> None:
        """Called before each backward; ``sync`` says whether this backward completes the gradients."""

    def end_backward(self) -> None:
        """Called after every backward (ZeRO-3 completes its per-pass bookkeeping here)."""

    @abc.abstractmethod
    def finish_gradients(self) -> None:
        """Complete every reduction: afterwards the gradients this rank owns are averaged over ranks.

        Called at the end of the boundary backward, so ``.grad`` is final when backward returns.
        """

    @abc.abstractmethod
    def global_grad_norm(self) -> torch.Tensor:
        """L2 norm over all gradients of all ranks (identical on every rank; inf/nan on overflow)."""

    @abc.abstractmethod
    def scale_gradients(self, factor: float) -> None:
        """Multiply every gradient this rank owns by ``factor`` (unscaling and clipping)."""

    @abc.abstractmethod
    def step(self) -> None:
        """Apply the optimizer and make the updated weights visible in the model's parameters."""

    @abc.abstractmethod
    def zero_grad(self) -> None: ...

    @abc.abstractmethod
    def consolidated_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Full fp32 weights by parameter name on rank 0 (``None`` elsewhere). Collective."""

    @abc.abstractmethod
    def memory_breakdown(self) -> dict[str, int]:
        """Bytes held between steps: ``params``, ``grads``, ``optimizer`` (state + fp32 masters), ``buffers``."""

    # [Note: checkpoint state] The checkpoint code (engine/checkpoint) saves and loads through these
    # two methods only; what it writes is keyed by parameter name and flat offset, never by rank.
    @abc.abstractmethod
    def sharded_state(self) -> list[OwnedSlice]:
        """This rank's slices of every parameter (fp32 masters where kept), with their optimizer tensors."""

    @abc.abstractmethod
    def refresh_from_masters(self) -> None:
        """Make the model's parameters show the values just written into the slices. Collective."""

    def slice_optimizer_state(self, owned: OwnedSlice) -> dict[str, Any] | None:
        """The optimizer state of one slice: tensors with the slice's elements, or scalars (``step``).

        Read from ``optimizer.state[owned.optimizer_param]``; a strategy whose optimizer keeps its
        state elsewhere (offload: one flat CPU/NVMe partition) overrides this and the next method.
        """
        if owned.optimizer_param is None:
            return None
        return self.optimizer.state.get(owned.optimizer_param) or None

    def load_slice_optimizer_state(self, owned: OwnedSlice, state: dict[str, Any] | None) -> None:
        """Install ``state`` (tensors already shaped and placed like ``owned.optimizer_param``); None clears it."""
        if state is None:
            self.optimizer.state.pop(owned.optimizer_param, None)
        else:
            self.optimizer.state[owned.optimizer_param] = state

    def load_sharded_state(self, read: Callable[[ParamSlice], torch.Tensor]) -> None:
        """Fill every slice this rank holds with ``read(slice)`` (any checkpoint slicing), then refresh."""
        with torch.no_grad():
            for owned in self.sharded_state():
                owned.value.copy_(read(owned.slice).reshape(-1))
        self.refresh_from_masters()

    def close(self) -> None:
        """Remove hooks (an engine can be discarded and the model wrapped again)."""
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
