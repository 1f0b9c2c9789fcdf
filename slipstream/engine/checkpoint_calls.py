"""The engine's checkpoint calls (DeepSpeed's names): save and load a training state, and what it is made of.

A mixin of :class:`~slipstream.engine.engine.Engine`, as ``SavesWeights`` (model_save.py) is for the
whole-model saves: ``engine/checkpoint/`` never sees the engine, so the engine builds the
``CheckpointTarget`` of ``Stateful`` pieces it hands over (``checkpoint_target``) here, and the calls
delegate to its ``CheckpointManager``. It reads the engine's loop state and its parts (the attributes
below) and three of its methods: ``micro_steps_in_window``, ``gradient_accumulation_steps`` and
``has_optimizer``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from slipstream.accelerator import Accelerator
from slipstream.engine.checkpoint.manager import CheckpointManager
from slipstream.engine.checkpoint.rng import RngState
from slipstream.engine.checkpoint.target import CheckpointTarget, Counters, TrainState
from slipstream.engine.config import SlipstreamConfig
from slipstream.engine.parallel.mesh import Mesh
from slipstream.engine.parallel.parallelize import Parallelized
from slipstream.engine.precision import LossScaler
from slipstream.engine.zero.strategy import ShardingStrategy


class CheckpointCalls:
    module: torch.nn.Module
    config: SlipstreamConfig
    mesh: Mesh
    parallel: Parallelized
    strategy: ShardingStrategy
    loss_scaler: LossScaler
    accelerator: Accelerator
    lr_scheduler: Any
    training_dataloader: Any
    checkpoints: CheckpointManager
    checkpoint_states: dict[str, Any]
    world_size: int
    global_steps: int
    micro_steps: int
    global_samples: int
    skipped_steps: int

    def save_checkpoint(
        self,
        save_dir: str | os.PathLike[str],
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> str:
        """Save everything needed to resume (any world size or stage) to ``save_dir/tag``. Call on every rank.

        ``exclude_frozen_parameters=True`` leaves out parameters with ``requires_grad=False``.
        """
        return str(
            self.checkpoints.save(
                self.checkpoint_target(),
                save_dir,
                tag,
                client_state,
                save_latest,
                self._pin(),
                self.accelerator.synchronize,
                exclude_frozen=exclude_frozen_parameters,
                mid_window=self.micro_steps_in_window() > 0,
            )
        )

    def _pin(self) -> Any:
        """How an asynchronous save pins its host copies (None on CPU: nothing to pin)."""
        return self.accelerator.pin_memory if self.accelerator.name != "cpu" else None

    def load_checkpoint(
        self,
        load_dir: str | os.PathLike[str],
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """Load ``load_dir/tag`` (default: ``latest``); returns ``(path, client_state)``, ``(None, None)`` if there is none.

        Also reads DeepSpeed checkpoints (ZeRO 0-3, universal) and torch DCP directories (FSDP2, torchtitan)."""
        return self.checkpoints.load(
            self.checkpoint_target(),
            load_dir,
            tag,
            strict=load_module_strict,
            optimizer=load_optimizer_states,
            scheduler=load_lr_scheduler_states,
            module_only=load_module_only,
        )

    def save_dcp(self, path: str | os.PathLike[str]) -> None:
        """Write ``path`` in torch DCP format as FSDP2's ``get_state_dict`` lays it out, each rank its own slices. Collective."""
        from slipstream.engine.checkpoint.formats.dcp import (
            save_dcp,  # torch.distributed.checkpoint costs ~0.9 s to import
        )

        self.checkpoints.wait()
        save_dcp(self.checkpoint_target(), path, optimizer=self.has_optimizer())

    def checkpoint_target(self) -> CheckpointTarget:
        """What a checkpoint saves and restores, as ``Stateful`` pieces (engine/checkpoint never sees the engine)."""
        extra: dict[str, Any] = {}
        loader = self.training_dataloader
        if loader is not None and hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict"):
            extra["training_dataloader"] = loader
        extra.update(self.checkpoint_states)
        scheduler = (
            self.lr_scheduler if self.lr_scheduler is not None and hasattr(self.lr_scheduler, "state_dict") else None
        )
        return CheckpointTarget(
            module=self.module,
            shards=self.strategy,
            optimizer=self.strategy.optimizer,
            scheduler=scheduler,
            loss_scaler=self.loss_scaler,
            counters=Counters(self._train_state, self._set_train_state),
            rng=RngState(self.accelerator.rng_state, self.accelerator.set_rng_state),
            extra=extra,
            config=self.config.model_dump(mode="json", by_alias=False, exclude_unset=True),
            zero_stage=self.config.zero_optimization.stage,
            precision=self.config.precision,
            world_size=self.world_size,
            spread=self.parallel.spread,
            mesh={axis: self.mesh.size(axis) for axis in self.mesh.coords},  # every axis: pp, dp, cp, sp, tp, ep
        )

    def _train_state(self) -> TrainState:
        return TrainState(
            self.global_steps,
            self.micro_steps,
            self.global_samples,
            self.skipped_steps,
            self.gradient_accumulation_steps(),
        )

    def _set_train_state(self, state: TrainState) -> None:
        self.global_steps, self.micro_steps = state.global_steps, state.micro_steps
        self.global_samples, self.skipped_steps = state.global_samples, state.skipped_steps

    def register_checkpoint_state(self, name: str, obj: Any) -> None:
        """Save ``obj`` (e.g. your data loader) in every checkpoint via its ``state_dict()``/``load_state_dict()``."""
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(f"register_checkpoint_state: {type(obj).__name__} has no state_dict()/load_state_dict()")
        self.checkpoint_states[name] = obj
