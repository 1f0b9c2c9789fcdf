"""Accelerate's DeepSpeed path, on Slipstream: ``SlipstreamAccelerator(slipstream_plugin=SlipstreamPlugin(...))``.

The switch is one line: ``Accelerator(deepspeed_plugin=DeepSpeedPlugin(...))`` becomes
``SlipstreamAccelerator(slipstream_plugin=SlipstreamPlugin(...))`` with the same fields (and the
same ``ACCELERATE_DEEPSPEED_*`` environment variables). ``prepare`` builds the engine; ``backward``
runs ``engine.backward`` and ``engine.step`` (the optimizer and scheduler returned by ``prepare``
step inside the engine, as with DeepSpeed); ``accumulate``, ``clip_grad_norm_``, ``save_state`` /
``load_state`` and ``unwrap_model`` behave as they do under DeepSpeed.

Under a model-parallel mesh (sequence, context, tensor or pipeline parallel) data loaders are
sharded by the data-parallel coordinate, not by process (see ``_mesh.py``): every rank of one
sequence/tensor/pipeline group reads the same micro-batches, ``"auto"`` batch sizes count dp, and
``gather_for_metrics`` returns each sample once.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.checkpointing import (
    load_accelerator_state,
    load_custom_state,
    save_accelerator_state,
    save_custom_state,
)
from accelerate.data_loader import get_sampler, prepare_data_loader
from accelerate.utils import broadcast_object_list, gather_object, recursively_apply

import slipstream
from slipstream.errors import UsageError
from slipstream.integrations._config import (
    apply_mixed_precision,
    fill_auto,
    fill_hidden_size_autos,
    get,
    inference_config,
)
from slipstream.integrations._engine import build_inference_engine, build_training_engine, inference_engine
from slipstream.integrations._launch import check_host_world_size, host_needs_cpu_flag
from slipstream.integrations._mesh import DataParallelLayout, check_engine, data_parallel_layout
from slipstream.integrations._plugin import DummyOptim, DummyScheduler, SlipstreamPlugin
from slipstream.integrations._wrappers import SlipstreamOptimizer, SlipstreamScheduler
from slipstream.utils.logging import get_logger

logger = get_logger(__name__)

__all__ = ["DummyOptim", "DummyScheduler", "SlipstreamAccelerator", "SlipstreamPlugin"]

CHECKPOINT_TAG = "pytorch_model"  # Accelerate's DeepSpeed checkpoint id for the first model


class SlipstreamState:
    """Accelerate's state as this accelerator's code sees it: ``deepspeed_plugin`` is the Slipstream plugin.

    Accelerate's DeepSpeed examples choose ``DummyOptim`` and ``DummyScheduler`` by reading
    ``accelerator.state.deepspeed_plugin.deepspeed_config``; without this they find None, build
    their own AdamW, and ``prepare`` refuses an optimizer in the config and in the code. Only this
    accelerator's view changes: ``AcceleratorState()`` elsewhere (Accelerate's internals, the
    Trainer, TRL) still says DeepSpeed is off, so no code path imports ``deepspeed``.
    """

    def __init__(self, state: Any, plugin: SlipstreamPlugin) -> None:
        object.__setattr__(self, "_state", state)
        object.__setattr__(self, "_plugin", plugin)

    @property
    def deepspeed_plugin(self) -> SlipstreamPlugin:
        return self._plugin

    @property
    def deepspeed_plugins(self) -> SlipstreamPlugin:
        return self._plugin

    def __getattr__(self, name: str) -> Any:
        return getattr(self._state, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._state, name, value)

    def __repr__(self) -> str:
        return repr(self._state)


class SlipstreamAccelerator(Accelerator):
    """An ``Accelerator`` whose models train on a Slipstream engine (ZeRO 0-3, offload, mixed precision)."""

    def __init__(self, *args: Any, slipstream_plugin: SlipstreamPlugin | None = None, **kwargs: Any) -> None:
        if kwargs.get("deepspeed_plugin") is not None:
            raise ValueError("SlipstreamAccelerator: pass slipstream_plugin= instead of deepspeed_plugin=")
        self.slipstream_plugin = slipstream_plugin if slipstream_plugin is not None else SlipstreamPlugin()
        gas = self.slipstream_plugin.gradient_accumulation_steps
        if (
            isinstance(gas, int)
            and "gradient_accumulation_steps" not in kwargs
            and "gradient_accumulation_plugin" not in kwargs
        ):
            kwargs["gradient_accumulation_steps"] = gas  # as Accelerate takes it from the DeepSpeed plugin
        if host_needs_cpu_flag() and "cpu" not in kwargs:
            kwargs["cpu"] = True  # several processes on a CPU machine (_launch.py)
        super().__init__(*args, **kwargs)
        check_host_world_size("Accelerator", self.num_processes)
        self.state = SlipstreamState(self.state, self.slipstream_plugin)  # type: ignore[assignment]
        self.engines: list[Any] = []
        # The Hugging Face Trainer divides the loss by the accumulation steps itself (SlipstreamTrainer sets this).
        self.caller_scales_loss = False
        self._dp_layout: DataParallelLayout | None = None

    # ------------------------------------------------------------------ data: sharded by dp (_mesh.py)
    @property
    def data_parallel_layout(self) -> DataParallelLayout:
        """This process's dp coordinate and the dp size, from the plugin's config (the engine's mesh agrees)."""
        if self._dp_layout is None:
            self._dp_layout = data_parallel_layout(
                self.slipstream_plugin.config, self.num_processes, self.process_index
            )
        return self._dp_layout

    def prepare_data_loader(
        self, data_loader: Any, device_placement: Any = None, slice_fn_for_dispatch: Any = None
    ) -> Any:
        """Accelerate's sharding, over dp coordinates: the ranks of one model-parallel group read the same batches."""
        layout = self.data_parallel_layout
        if not layout.shared or getattr(data_loader, "_is_accelerate_prepared", False):
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        if self.dispatch_batches:
            raise ValueError(
                "SlipstreamAccelerator: dispatch_batches=True slices each batch per process, but under a model-parallel "
                f"mesh ({layout.sharers} ranks per micro-batch) ranks of one group must read the same batch; "
                "use dispatch_batches=False"
            )
        data_seed = self._same_order_on_every_rank(data_loader)
        prepared = prepare_data_loader(
            data_loader,
            self.device,
            num_processes=layout.size,
            process_index=layout.rank,
            split_batches=self.split_batches,
            put_on_device=self.device_placement if device_placement is None else device_placement,
            rng_types=self.rng_types.copy(),
            dispatch_batches=False,
            even_batches=self.even_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch,
            use_seedable_sampler=self.use_seedable_sampler,
            data_seed=data_seed,
            non_blocking=self.non_blocking,
            use_stateful_dataloader=self.use_stateful_dataloader,
            torch_device_mesh=None,
        )
        self._dataloaders.append(prepared)
        return prepared

    def _same_order_on_every_rank(self, data_loader: Any) -> Any:
        """Rank 0's shuffling seed for every rank; the data seed to prepare with.

        Accelerate keeps a shuffled order in step by broadcasting the sampler's generator from
        rank 0, but only when it shards (dp > 1), and its seedable sampler starts from each
        process's own initial seed; ranks sharing a micro-batch must shuffle identically always.
        """
        seed = self.dataloader_config.data_seed
        sampler = get_sampler(data_loader)
        if not isinstance(sampler, torch.utils.data.RandomSampler):
            return seed
        if self.use_seedable_sampler:
            shared = [seed if seed is not None else torch.random.initial_seed()]
            broadcast_object_list(shared)
            return shared[0]
        if sampler.generator is None:
            sampler.generator = torch.Generator()
            sampler.generator.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
        state = [sampler.generator.get_state()]
        broadcast_object_list(state)
        sampler.generator.set_state(state[0])
        return seed

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Accelerate's ``gather_for_metrics`` with each micro-batch counted once (from one rank per dp coordinate)."""
        layout = self.data_parallel_layout
        if not layout.shared:
            return super().gather_for_metrics(input_data, use_gather_object=use_gather_object)
        try:
            recursively_apply(lambda x: x, input_data, error_on_other_type=True)
            all_tensors = True
        except TypeError:
            all_tensors = False
        readers = list(layout.readers)
        if use_gather_object or not all_tensors:
            per_rank = gather_object([input_data])
            data = [x for rank in readers for x in per_rank[rank]]
        else:
            world = layout.world
            data = recursively_apply(
                lambda t: t.reshape(world, -1, *t.shape[1:])[readers].flatten(0, 1), self.gather(input_data)
            )
        state = self.gradient_state
        if state.end_of_dataloader and state.remainder > 0:  # the last batch was padded with repeated samples
            if isinstance(data, list):
                return data[: state.remainder]
            return recursively_apply(lambda t: t[: state.remainder], data)
        return data

    # ------------------------------------------------------------------ prepare
    def prepare(self, *args: Any, device_placement: Any = None) -> Any:
        models = [a for a in args if isinstance(a, torch.nn.Module) and not isinstance(a, slipstream.Engine)]
        if not models:
            return super().prepare(*args, device_placement=device_placement)
        if len(models) > 1:
            raise ValueError("SlipstreamAccelerator.prepare: one model per call (one engine per model)")
        optimizers = [a for a in args if isinstance(a, (torch.optim.Optimizer, DummyOptim))]
        schedulers = [a for a in args if _is_scheduler(a)]
        others = [a for a in args if a is not models[0] and a not in optimizers and a not in schedulers]
        prepared_others = super().prepare(*others, device_placement=device_placement) if others else ()
        if len(others) == 1:
            prepared_others = (prepared_others,)
        engine = self._build_engine(
            models[0], optimizers[0] if optimizers else None, schedulers[0] if schedulers else None
        )
        result = []
        rest = iter(prepared_others)
        for a in args:
            if a is models[0]:
                result.append(engine)
            elif optimizers and a is optimizers[0]:
                result.append(self._optimizers[-1])
            elif schedulers and a is schedulers[0]:
                result.append(self._schedulers[-1])
            else:
                result.append(next(rest))
        return result[0] if len(result) == 1 else tuple(result)

    def _build_engine(self, model: torch.nn.Module, optimizer: Any, scheduler: Any) -> Any:
        config = self._filled_config(model, optimizer, scheduler)
        user_optimizer = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
        if user_optimizer is not None and "optimizer" in config:
            raise ValueError(
                "You cannot specify an optimizer in the config file and in the code at the same time. Please remove "
                "the optimizer from the config file or create `DummyOptim` in the code."
            )
        if isinstance(optimizer, DummyOptim) and "optimizer" not in config:
            raise ValueError(
                "You cannot create a `DummyOptim` without specifying an optimizer in the config file "
                '(add an "optimizer" section).'
            )
        params = optimizer.params if isinstance(optimizer, DummyOptim) else None
        user_scheduler = scheduler if scheduler is not None and not isinstance(scheduler, DummyScheduler) else None
        callable_scheduler = None
        if isinstance(scheduler, DummyScheduler) and "scheduler" not in config:
            if scheduler.lr_scheduler_callable is None:
                raise ValueError(
                    "You cannot create a `DummyScheduler` without specifying a scheduler in the config file "
                    '(add a "scheduler" section, or give DummyScheduler an lr_scheduler_callable).'
                )
            callable_scheduler = scheduler.lr_scheduler_callable
        engine = build_training_engine(
            model, config, optimizer=user_optimizer, lr_scheduler=callable_scheduler, model_parameters=params
        )
        check_engine(self.data_parallel_layout, engine)
        self.engines.append(engine)
        self._models.append(engine)
        self._optimizers.append(SlipstreamOptimizer(engine))
        if scheduler is not None:
            # A scheduler the user built over their optimizer follows it (the engine rebinds it in place)
            # and is saved with the engine's checkpoint.
            wrapped = SlipstreamScheduler(engine, user_scheduler)
            if user_scheduler is not None:
                engine.register_checkpoint_state("accelerate_lr_scheduler", user_scheduler)
            self._schedulers.append(wrapped)
        return engine

    def _filled_config(self, model: torch.nn.Module, optimizer: Any, scheduler: Any) -> dict[str, Any]:
        """Accelerate's DeepSpeed "auto" filling: batch sizes from the data loader, optimizer and schedule from the dummies."""
        config = self.slipstream_plugin.config_copy()
        apply_mixed_precision(config, str(self.mixed_precision), "Accelerator(mixed_precision=...) / --mixed_precision")
        # A loader's total batch is the micro-batch of every dp coordinate together (ranks that share a
        # micro-batch read it once): the micro-batch and train_batch_size count dp, not processes.
        dp = self.data_parallel_layout.size
        batch = next((getattr(d, "total_batch_size", None) for d in self._dataloaders), None)
        mb = get(config, "train_micro_batch_size_per_gpu")
        if mb == "auto" and batch is not None:
            fill_auto(config, "train_micro_batch_size_per_gpu", batch // dp)
        fill_auto(config, "gradient_accumulation_steps", self.gradient_accumulation_steps)
        mb = get(config, "train_micro_batch_size_per_gpu")
        gas = get(config, "gradient_accumulation_steps")
        if isinstance(mb, int) and isinstance(gas, int):
            fill_auto(config, "train_batch_size", mb * gas * dp)
        if get(config, "gradient_clipping") == "auto":
            config.pop("gradient_clipping")
        if isinstance(optimizer, DummyOptim):
            fill_auto(config, "optimizer.params.lr", optimizer.lr)
            fill_auto(config, "optimizer.params.weight_decay", optimizer.weight_decay)
            for key in ("betas", "eps"):
                if key in optimizer.kwargs:
                    fill_auto(config, f"optimizer.params.{key}", optimizer.kwargs[key])
        for key in ("betas", "eps"):  # the optimizer's own defaults
            parent = get(config, "optimizer.params")
            if isinstance(parent, dict) and parent.get(key) == "auto":
                parent.pop(key)
        if isinstance(scheduler, DummyScheduler):
            lr = get(config, "optimizer.params.lr")
            fill_auto(config, "scheduler.params.total_num_steps", scheduler.total_num_steps)
            fill_auto(config, "scheduler.params.warmup_num_steps", max(1, scheduler.warmup_num_steps or 0))
            fill_auto(config, "scheduler.params.warmup_min_lr", 0)
            fill_auto(config, "scheduler.params.warmup_max_lr", lr)
        fill_hidden_size_autos(config, model)
        self._compile_as_asked(config)
        return config

    def _compile_as_asked(self, config: dict[str, Any]) -> None:
        """``Accelerator(dynamo_backend=...)`` / the Trainer's ``torch_compile`` (its dynamo plugin) turns the ``compile``
        section on with its backend and arguments, unless the config compiles already: under DeepSpeed a Trainer's
        ``torch_compile`` is dropped (transformers#23095); here each block is compiled (docs/compile.md)."""
        dynamo = getattr(self.state, "dynamo_plugin", None)
        backend = getattr(getattr(dynamo, "backend", None), "value", None)
        section = config.get("compile") or {}
        if not backend or backend == "NO" or section.get("enabled") or section.get("deepcompile"):
            return
        kwargs = {
            k: v for k in ("mode", "fullgraph", "dynamic", "options") if (v := getattr(dynamo, k, None)) is not None
        }
        config["compile"] = {
            **section,
            "enabled": True,
            "backend": backend.lower(),
            "kwargs": {**kwargs, **section.get("kwargs", {})},
        }

    # ------------------------------------------------------------------ training calls
    def _engine(self) -> Any:
        if not self.engines:
            raise UsageError("SlipstreamAccelerator: call prepare(model, optimizer, ...) before backward()")
        return self.engines[-1]

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``engine.backward`` then ``engine.step`` (a no-op between accumulation boundaries), as Accelerate does for DeepSpeed."""
        engine = self._engine()
        engine.set_gradient_accumulation_boundary(self.sync_gradients)
        scale_wrt_gas = kwargs.pop("scale_wrt_gas", not self.caller_scales_loss)
        engine.backward(loss, retain_graph=kwargs.pop("retain_graph", False), scale_wrt_gas=scale_wrt_gas)
        engine.step()

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        """The engine clips at ``gradient_clipping`` during its step; this returns the norm before clipping."""
        engine = self._engine()
        configured = engine.config.gradient_clipping
        if max_norm not in (configured, float("inf")) and not getattr(self, "_clip_warned", False):
            self._clip_warned = True
            logger.warning(
                "clip_grad_norm_(max_norm=%s): the engine clips at gradient_clipping=%s from the config "
                "(set it there, or gradient_clipping= on SlipstreamPlugin)",
                max_norm,
                configured,
            )
        return engine.get_global_grad_norm(as_tensor=True)  # read by the Trainer only when it logs

    def unwrap_model(self, model: Any, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True) -> Any:
        if isinstance(model, slipstream.Engine):
            return model.module
        return super().unwrap_model(model, keep_fp32_wrapper=keep_fp32_wrapper, keep_torch_compile=keep_torch_compile)

    def prepare_model(self, model: torch.nn.Module, device_placement: Any = None, evaluation_mode: bool = False) -> Any:
        """``evaluation_mode``: a model that only runs forward (TRL's reference models); at ZeRO-3 it is partitioned too.

        As TRL's DeepSpeed path does for its reference model, the model gets an engine without an
        optimizer, whose hooks gather each unit for its forward; the model itself is returned, so
        the host calls it as before.
        """
        if not evaluation_mode:
            return self.prepare(model)
        config = self.slipstream_plugin.config_copy()
        if inference_engine(model) is None and get(config, "zero_optimization.stage") == 3:
            apply_mixed_precision(
                config, str(self.mixed_precision), "Accelerator(mixed_precision=...) / --mixed_precision"
            )
            build_inference_engine(model, inference_config(config, model))
        return model

    def get_state_dict(self, model: Any, unwrap: bool = True) -> dict[str, torch.Tensor] | None:
        """Full weights in the training dtype on the main process (collective for an engine)."""
        if isinstance(model, slipstream.Engine):
            state = model.consolidated_state_dict(dtype=model.training_dtype)
            return state
        return super().get_state_dict(model, unwrap=unwrap)

    # ------------------------------------------------------------------ checkpoints
    def save_state(
        self, output_dir: str | None = None, safe_serialization: bool = True, **save_model_func_kwargs: Any
    ) -> str:
        """The engines' checkpoints (weights, optimizer, schedule) plus Accelerate's RNG, data-loader and custom state."""
        if output_dir is None:
            raise ValueError("SlipstreamAccelerator.save_state: give output_dir")
        os.makedirs(output_dir, exist_ok=True)
        for i, engine in enumerate(self.engines):
            engine.save_checkpoint(
                output_dir, tag=CHECKPOINT_TAG if i == 0 else f"{CHECKPOINT_TAG}_{i}", **save_model_func_kwargs
            )
        location = save_accelerator_state(
            output_dir,
            [],
            [],
            [],
            self._dataloaders,
            self.state.process_index,
            self.step,
            self.scaler,
            save_on_each_node=self.project_configuration.save_on_each_node,
            safe_serialization=safe_serialization,
        )
        for i, obj in enumerate(self._custom_objects):
            save_custom_state(obj, output_dir, i, save_on_each_node=self.project_configuration.save_on_each_node)
        self.wait_for_everyone()
        return str(location)

    def load_state(
        self, input_dir: str | None = None, load_kwargs: dict | None = None, **load_model_func_kwargs: Any
    ) -> None:
        if input_dir is None:
            raise ValueError("SlipstreamAccelerator.load_state: give input_dir")
        for i, engine in enumerate(self.engines):
            engine.load_checkpoint(
                input_dir, tag=CHECKPOINT_TAG if i == 0 else f"{CHECKPOINT_TAG}_{i}", **load_model_func_kwargs
            )
        override = load_accelerator_state(
            input_dir, [], [], [], self._dataloaders, self.state.process_index, self.scaler
        )
        if "step" in override:
            self.step = override["step"]
        for i, obj in enumerate(self._custom_objects):
            load_custom_state(obj, input_dir, i)

    def free_memory(self, *objects: Any) -> Any:
        for engine in self.engines:
            engine.close()
        self.engines = []
        return super().free_memory(*objects)


def _is_scheduler(obj: Any) -> bool:
    return isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, DummyScheduler)) or (
        hasattr(obj, "step") and hasattr(obj, "get_last_lr") and not isinstance(obj, torch.optim.Optimizer)
    )
