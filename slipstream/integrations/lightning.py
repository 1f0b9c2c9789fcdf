"""Lightning on Slipstream: ``Trainer(strategy="slipstream_stage_2")`` after ``import slipstream.integrations.lightning``.

Registered names: ``"slipstream"`` (ZeRO-2), ``"slipstream_stage_{1,2,3}"``, ``"slipstream_stage_2_offload"``
and ``"slipstream_stage_3_offload"`` (optimizer state, and at stage 3 parameters, in CPU memory),
the same set Lightning registers for DeepSpeed. ``SlipstreamStrategy(config=...)`` takes a full
DeepSpeed config instead.

[Note: who does what] As with Lightning's DeepSpeed strategy, the engine owns gradient
accumulation, clipping (``Trainer(gradient_clip_val=...)`` goes into the config) and the optimizer
step; Lightning still calls ``training_step``, steps the LR schedulers of ``configure_optimizers``
(the engine updates the very optimizer they were built over) and saves its loop state inside the
engine's checkpoint (a directory, like DeepSpeed's). Lightning already divides the loss by
``accumulate_grad_batches``, so the engine does not divide it again. Lightning's distributed
sampler shards by the data-parallel coordinate (``_mesh.py``), so under sequence, context, tensor
or pipeline parallelism the ranks of one group read the same batches.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn

import slipstream
from slipstream.errors import UsageError
from slipstream.integrations._config import apply_mixed_precision, read_config
from slipstream.integrations._mesh import data_parallel_layout

__all__ = ["SlipstreamPrecision", "SlipstreamStrategy"]

CHECKPOINT_TAG = "checkpoint"
# Trainer(precision=...) flags and the config section each one turns on ("no": the config decides).
_PRECISIONS = {
    "32-true": "no",
    "32": "no",
    "16-mixed": "fp16",
    "16-true": "fp16",
    "16": "fp16",
    "bf16-mixed": "bf16",
    "bf16-true": "bf16",
    "bf16": "bf16",
}


class SlipstreamPrecision(Precision):
    """Backward and step through the engine; the engine casts to fp16/bf16 from the config."""

    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        engine = model.trainer.strategy.engine
        engine.backward(tensor, scale_wrt_gas=False)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:  # type: ignore[override]
        closure_result = closure()
        self._after_closure(model, optimizer)
        if closure_result is None and model.automatic_optimization:
            raise UsageError(
                "SlipstreamStrategy: skipping backward by returning None from training_step is not supported"
            )
        model.trainer.strategy.engine.step()
        return closure_result

    def clip_gradients(self, optimizer: Any, clip_val: Any = 0.0, gradient_clip_algorithm: Any = None) -> None:
        return None  # the engine clips at the config's gradient_clipping


class SlipstreamStrategy(DDPStrategy):
    """Train a ``LightningModule`` on a Slipstream engine (ZeRO 0-3, offload, mixed precision)."""

    strategy_name = "slipstream"

    def __init__(
        self,
        stage: int = 2,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        config: str | dict[str, Any] | None = None,
        accelerator: Any = None,
        parallel_devices: Any = None,
        cluster_environment: Any = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,  # None: Trainer(precision=) decides
        )
        if config is not None:
            self.config = read_config(config)
        else:
            zero: dict[str, Any] = {"stage": stage}
            if offload_optimizer:
                zero["offload_optimizer"] = {"device": "cpu"}
            if offload_parameters:
                zero["offload_param"] = {"device": "cpu"}
            self.config = {"zero_optimization": zero}
        self.engine: Any = None
        self.host_precision = getattr(self, "host_precision", "no")  # Trainer(precision=...) may have set it already

    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else SlipstreamPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # The Trainer hands every strategy the plugin of its `precision=` flag. The engine casts, so the
        # flag becomes the config's fp16/bf16 section (as Lightning's DeepSpeed strategy maps it) and the
        # engine's own plugin takes its place.
        if plugin is not None and not isinstance(plugin, SlipstreamPrecision):
            flag = str(getattr(plugin, "precision", "32-true"))
            if flag not in _PRECISIONS:
                raise ValueError(
                    f"SlipstreamStrategy: Trainer(precision={flag!r}) is not supported; use one of {', '.join(_PRECISIONS)} "
                    "(or set the fp16/bf16 section of the config)"
                )
            self.host_precision = _PRECISIONS[flag]
            plugin = SlipstreamPrecision()
        self._precision_plugin = plugin

    # ------------------------------------------------------------------ set-up
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.optimizers, self.lr_scheduler_configs = [], []
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            self._build_training_engine(trainer)
        else:
            self.engine = slipstream.initialize(self.model, self._config(trainer, training=False), inference=True)
            self.model = self.engine
        self.barrier()

    def _config(self, trainer: Any, training: bool) -> dict[str, Any]:
        config = copy.deepcopy(self.config)
        config.setdefault("steps_per_print", 0)
        apply_mixed_precision(config, self.host_precision, "Trainer(precision=...)")
        if training:
            if (
                "gradient_accumulation_steps" in config
                and config["gradient_accumulation_steps"] != trainer.accumulate_grad_batches
            ):
                raise ValueError(
                    "SlipstreamStrategy: gradient_accumulation_steps in the config differs from "
                    "Trainer(accumulate_grad_batches=...); set it in one place"
                )
            config["gradient_accumulation_steps"] = trainer.accumulate_grad_batches
            if "gradient_clipping" not in config:
                config["gradient_clipping"] = trainer.gradient_clip_val or 0.0
        if not any(k in config for k in ("train_batch_size", "train_micro_batch_size_per_gpu")):
            config["train_micro_batch_size_per_gpu"] = _loader_batch_size(trainer)
        return config

    def _build_training_engine(self, trainer: Any) -> None:
        config = self._config(trainer, training=True)
        optimizer = None
        if "optimizer" not in config:
            optimizers, schedulers = _init_optimizers_and_lr_schedulers(self.lightning_module)
            if len(optimizers) != 1 or len(schedulers) > 1:
                raise ValueError("SlipstreamStrategy: one optimizer and at most one LR scheduler (as with DeepSpeed)")
            optimizer = optimizers[0]
            self.lr_scheduler_configs = schedulers
        self.engine = slipstream.initialize(self.model, config, optimizer=optimizer)
        self.model = self.engine
        self.optimizers = [self.engine.optimizer]

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Shard by dp, not by process: ranks that differ only in pp, cp, sp or tp read the same batches."""
        layout = data_parallel_layout(self.config, self.world_size, self.global_rank)
        return {"num_replicas": layout.size, "rank": layout.rank}

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model  # no DDP wrapper: the engine reduces the gradients

    def setup_optimizers(self, trainer: Any) -> None:
        self.optimizers, self.lr_scheduler_configs = [], []  # built with the engine in setup()

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine must exist to load its checkpoint

    # ------------------------------------------------------------------ checkpoints
    # The engine stays attached after fit() (as DeepSpeed's does), so trainer.save_checkpoint() still works.
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the weights live, sharded, in the engine's checkpoint

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        filepath = self.broadcast(str(filepath))
        client_state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        self.engine.save_checkpoint(filepath, tag=CHECKPOINT_TAG, client_state=client_state)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        path, client_state = self.engine.load_checkpoint(
            str(checkpoint_path),
            tag=CHECKPOINT_TAG,
            load_optimizer_states=fitting,
            load_lr_scheduler_states=False,
            load_module_strict=self.lightning_module.strict_loading,
        )
        if path is None or client_state is None:
            raise FileNotFoundError(f"SlipstreamStrategy: no Slipstream checkpoint in {checkpoint_path}")
        return client_state

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # restored by the engine with its checkpoint

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        return None  # restored by the engine with its checkpoint

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        return None

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        names = {
            "slipstream": {"stage": 2},
            "slipstream_stage_1": {"stage": 1},
            "slipstream_stage_2": {"stage": 2},
            "slipstream_stage_2_offload": {"stage": 2, "offload_optimizer": True},
            "slipstream_stage_3": {"stage": 3},
            "slipstream_stage_3_offload": {"stage": 3, "offload_optimizer": True, "offload_parameters": True},
        }
        for name, kwargs in names.items():
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=f"Slipstream ZeRO {kwargs}", **kwargs)


def _loader_batch_size(trainer: Any) -> int:
    source = trainer.fit_loop._data_source
    if source.is_defined():
        loader = source.dataloader()
        size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None) or getattr(
            loader, "batch_size", None
        )
        if size:
            return int(size)
    return 1


SlipstreamStrategy.register_strategies(StrategyRegistry)
