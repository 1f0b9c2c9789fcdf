"""What the checkpoint code is handed instead of the engine: ``Stateful`` pieces and a counters record.

[Note: no Engine here] The engine builds a :class:`CheckpointTarget` for each save or load (see
``Engine.checkpoint_target``). Everything in it is either a ``Stateful`` (``state_dict`` /
``load_state_dict``) or a read-only fact (module for names and shapes, config, world size, mesh), so
the checkpoint package never imports the engine and never writes engine attributes: the counters
come back through the engine's own :class:`TrainState` Stateful.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from slipstream.engine.zero.slices import OwnedSlice
from slipstream.utils.pieces import ParamSlice


@runtime_checkable
class Stateful(Protocol):
    """Anything saved through its own state_dict (torch's optimizers, schedulers, data loaders...)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


class ShardedState(Protocol):
    """The strategy's side: which slices of which parameters this rank holds, and their optimizer state."""

    def sharded_state(self) -> list[OwnedSlice]: ...

    def slice_optimizer_state(self, owned: OwnedSlice) -> dict[str, Any] | None: ...

    def load_slice_optimizer_state(self, owned: OwnedSlice, state: dict[str, Any] | None) -> None: ...

    def load_sharded_state(self, read: Callable[[ParamSlice], torch.Tensor]) -> None: ...


@dataclasses.dataclass(frozen=True)
class TrainState:
    """The training counters a checkpoint saves (the step record)."""

    global_steps: int = 0
    micro_steps: int = 0
    global_samples: int = 0
    skipped_steps: int = 0
    gradient_accumulation_steps: int = 1


class Counters:
    """A ``Stateful`` view of the owner's counters: ``get`` reads them, ``put`` writes them back."""

    def __init__(self, get: Callable[[], TrainState], put: Callable[[TrainState], None]) -> None:
        self._get, self._put = get, put

    def record(self) -> TrainState:
        return self._get()

    def state_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self._get())

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self._put(TrainState(**{f.name: int(state[f.name]) for f in dataclasses.fields(TrainState)}))


@dataclasses.dataclass(frozen=True)
class CheckpointTarget:
    """Everything one rank saves and restores. ``extra`` holds the data loader and registered objects."""

    module: torch.nn.Module  # names, shapes and persistent buffers
    shards: ShardedState
    optimizer: torch.optim.Optimizer  # its param_groups (hyperparameters) only; slice states go through ``shards``
    scheduler: Stateful | None
    loss_scaler: Stateful
    counters: Counters
    rng: Stateful
    extra: Mapping[str, Stateful]
    config: dict[str, Any]  # the engine's config as JSON
    zero_stage: int
    precision: str
    world_size: int
    spread: bool = (
        False  # ranks hold different parts of the model (tp/pp/ep): the manifest is the union of every rank's
    )
    # The mesh's axis sizes (pp, dp, cp, sp, tp, ep), recorded in the manifest for ``checkpoint inspect``;
    # empty: not recorded. Informational only: a checkpoint loads under any mesh.
    mesh: Mapping[str, int] = dataclasses.field(default_factory=dict)
