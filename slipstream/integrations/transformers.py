"""The Hugging Face ``Trainer`` on Slipstream: ``SlipstreamTrainer`` + ``SlipstreamTrainingArguments``.

The switch is one line each: ``Trainer`` → ``SlipstreamTrainer``, ``TrainingArguments`` →
``SlipstreamTrainingArguments``; ``--deepspeed ds_config.json`` (or ``deepspeed=``) keeps naming the
config, and its ``"auto"`` values are filled exactly as the DeepSpeed integration fills them.

[Note: extension points only] The subclasses override the Trainer's documented hooks
(``create_accelerator_and_postprocess``, ``create_optimizer``/``create_scheduler``, ``save_model``,
checkpoint save/load) and hand it a :class:`SlipstreamAccelerator`, so the Trainer's own loop runs
unchanged: it divides the loss by the accumulation steps, forces a boundary on an epoch's last
batch, and the engine does the rest. Nothing is patched and no ``deepspeed`` module is faked.

[Note: model-parallel meshes] Under sequence, context, tensor or pipeline parallelism the ranks of
one group read the same micro-batches (the accelerator shards the loader by dp, ``_mesh.py``).
The Trainer already divides its label count and its loss scale by the number of processes that
share a batch, which it asks of ``get_tp_size``; here that is world / dp. Under sequence or context
parallelism the model runs without ``num_items_in_batch`` (the engine reports the micro-batch's
whole-sequence *mean* from per-shard means) and :meth:`SlipstreamTrainer.compute_loss` turns that
mean into the Trainer's token sum over the window's label count, so the loss trained and logged is
the one a single process would see.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from typing import Any

import torch
from transformers import Trainer, TrainingArguments

from slipstream.integrations._config import get, inference_config, read_config
from slipstream.integrations._engine import build_inference_engine, inference_engine
from slipstream.integrations._hf_auto import AutoFiller
from slipstream.integrations._hf_load import from_pretrained
from slipstream.integrations._launch import check_host_world_size, host_needs_cpu_flag
from slipstream.integrations._plugin import DummyOptim, SlipstreamPlugin
from slipstream.integrations._wrappers import SlipstreamScheduler
from slipstream.integrations.accelerate import SlipstreamAccelerator

__all__ = ["SlipstreamTrainer", "SlipstreamTrainingArguments", "from_pretrained", "slipstream_trainer"]


class SlipstreamArgumentsMixin:
    """What makes a ``TrainingArguments`` (or any subclass) run its ``deepspeed`` config on Slipstream."""

    def __post_init__(self) -> None:
        source, self.deepspeed = self.deepspeed, None  # keep transformers' DeepSpeed set-up out of the way
        if host_needs_cpu_flag():
            self.use_cpu = True  # several processes on a CPU machine (_launch.py)
        super().__post_init__()
        _ = self.device  # settle the device set-up before `deepspeed` holds a value again
        self.deepspeed = source
        if source:
            check_host_world_size("TrainingArguments", self.world_size)
        self.slipstream_filler: AutoFiller | None = None
        if source:
            self.slipstream_filler = AutoFiller(read_config(source))
            self.slipstream_filler.from_arguments(self)

    @property
    def slipstream_config(self) -> dict[str, Any] | None:
        """The config with the ``"auto"`` values filled so far."""
        return None if self.slipstream_filler is None else self.slipstream_filler.config


@dataclasses.dataclass
class SlipstreamTrainingArguments(SlipstreamArgumentsMixin, TrainingArguments):
    """``TrainingArguments`` whose ``deepspeed`` config runs on Slipstream (no ``deepspeed`` package needed)."""


class SlipstreamTrainerMixin:
    """What makes a ``Trainer`` (or any subclass: TRL's, ``Seq2SeqTrainer``...) train on a Slipstream engine."""

    def __init__(self, *positional: Any, **kwargs: Any) -> None:
        # The host's own signature says where its arguments object is (DPOTrainer takes ref_model second).
        args = inspect.signature(super().__init__).bind_partial(*positional, **kwargs).arguments.get("args")
        if args is None or not isinstance(args, SlipstreamArgumentsMixin) or not args.deepspeed:
            raise ValueError(
                f'{type(self).__name__}: pass args=SlipstreamTrainingArguments(..., deepspeed="ds_config.json") (for a '
                "Trainer subclass, the arguments class slipstream_trainer() returned with it), or --deepspeed "
                "ds_config.json through HfArgumentParser"
            )
        stages = get(args.slipstream_config or {}, "pipeline.stages")
        if isinstance(stages, int) and stages > 1:
            raise ValueError(
                f"{type(self).__name__}: pipeline.stages={stages} is not supported under the Trainer: its loop scales and "
                "logs each micro-batch's loss before backward, and under a pipeline a micro-batch's loss exists only once "
                "the window's schedule has run (DeepSpeed's Trainer integration has no pipeline either); train with "
                "engine.train_batch() or your own engine(batch)/backward/step loop, or use tensor_parallel instead"
            )
        super().__init__(*positional, **kwargs)

    def _move_model_to_device(self, model: Any, device: Any) -> None:
        return None  # slipstream.initialize places (and at ZeRO-3 partitions) the model, as DeepSpeed does

    # ------------------------------------------------------------------ the accelerator
    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        built = super()._build_accelerator_args(**kwargs)
        built["deepspeed_plugin"] = None
        built["mixed_precision"] = "no"  # the engine casts (fp16/bf16 from the config); no autocast on top
        self._slipstream_accelerator_args = built
        return built

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        plugin = SlipstreamPlugin(hf_ds_config=self.args.slipstream_config)
        self.accelerator = SlipstreamAccelerator(slipstream_plugin=plugin, **self._slipstream_accelerator_args)
        self.accelerator.caller_scales_loss = True  # training_step divides by the accumulation steps
        self.gather_function = self.accelerator.gather_for_metrics

    def _engine(self) -> Any:
        accelerator = getattr(self, "accelerator", None)
        if accelerator is not None and accelerator.engines:
            return accelerator.engines[-1]
        return inference_engine(self.model)

    # ------------------------------------------------------------------ model-parallel meshes (see the module's note)
    def get_tp_size(self) -> int:
        """How many processes read each batch (world / dp): the Trainer divides its label count and loss scale by it."""
        accelerator = getattr(self, "accelerator", None)
        if isinstance(accelerator, SlipstreamAccelerator):
            return accelerator.data_parallel_layout.sharers
        return super().get_tp_size()

    def compute_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        """The Trainer's loss; under sequence or context parallelism, normalised by ``num_items_in_batch`` here."""
        accelerator = getattr(self, "accelerator", None)
        if (
            num_items_in_batch is None
            or not isinstance(accelerator, SlipstreamAccelerator)
            or not accelerator.data_parallel_layout.sequence_split
            or not self.model_accepts_loss_kwargs
            or self.compute_loss_func is not None
            or self.label_smoother is not None
            or "labels" not in inputs
        ):
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        # The engine's loss is the micro-batch's mean over its labelled tokens (shifted, as the engine shifts them
        # before cutting the sequences); times that count over the window's count, it is the model's own
        # `sum / num_items_in_batch`, then scaled as the Trainer scales it.
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True)
        labels = inputs["shift_labels"] if "shift_labels" in inputs else inputs["labels"][..., 1:]
        loss = loss * labels.ne(-100).sum().to(loss.dtype) / num_items_in_batch
        if self.args.average_tokens_across_devices:
            loss = loss * (accelerator.num_processes // self.get_tp_size() if self.args.n_gpu <= 1 else self.args.n_gpu)
        return (loss, outputs) if return_outputs else loss

    # ------------------------------------------------------------------ optimizer and schedule
    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: Any) -> Any:
        filler = self.args.slipstream_filler
        assert filler is not None
        filler.at_training_start(self.args, self.model, max_steps)
        self.accelerator.slipstream_plugin.config = filler.config
        return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)

    def create_optimizer(self, model: Any = None) -> Any:
        if self.optimizer is None and "optimizer" in self.args.slipstream_config:
            # The config's optimizer is built by the engine, as DeepSpeed builds it.
            params = [p for p in (model or self.model).parameters() if p.requires_grad]
            self.optimizer = DummyOptim(params=params)
            return self.optimizer
        return super().create_optimizer(model)

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        engine = self._engine()
        if self.lr_scheduler is None and engine is not None and "scheduler" in self.args.slipstream_config:
            self.lr_scheduler = SlipstreamScheduler(engine)
            self._created_lr_scheduler = True
            return self.lr_scheduler
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        if engine is not None and scheduler is not None and hasattr(scheduler, "state_dict"):
            engine.register_checkpoint_state("hf_lr_scheduler", scheduler)  # resumes with the engine
        return scheduler

    # ------------------------------------------------------------------ saving and resuming
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Full weights at every stage (gathered from the shards on every rank, written by the main process)."""
        engine = self._engine()
        if engine is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state = engine.gathered_model_state_dict()
        if self.args.should_save:
            self._save(output_dir, state_dict=state)
        self.accelerator.wait_for_everyone()

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        engine = self._engine()
        if engine is None or not engine.has_optimizer():
            return super()._save_optimizer_and_scheduler(output_dir)
        engine.save_checkpoint(output_dir)  # weights (fp32 masters), optimizer, schedule, RNG: resumes bit for bit

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if os.path.isfile(os.path.join(resume_from_checkpoint, "latest")):
            return None  # a Slipstream checkpoint: the engine loads the weights with the optimizer state
        return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        engine = self._engine()
        if checkpoint is None or engine is None or not os.path.isfile(os.path.join(checkpoint, "latest")):
            return super()._load_optimizer_and_scheduler(checkpoint)
        path, _ = engine.load_checkpoint(checkpoint)
        if path is None:
            raise FileNotFoundError(f"SlipstreamTrainer: no loadable checkpoint in {checkpoint}")
        if not os.path.isfile(
            os.path.join(path, "manifest.json")
        ):  # DeepSpeed's (or DCP): the Trainer kept its own schedule
            self._load_host_scheduler(checkpoint)

    def _load_host_scheduler(self, checkpoint: str) -> None:
        """The Trainer's own schedule of a DeepSpeed run: the Trainer saved it beside DeepSpeed's files as scheduler.pt.

        Read with ``weights_only=True``: a schedule's state is numbers and lists (a schedule whose
        state holds code is refused by torch in one line, never run).
        """
        file = os.path.join(checkpoint, "scheduler.pt")
        scheduler = self.lr_scheduler
        if isinstance(scheduler, SlipstreamScheduler) or scheduler is None or not os.path.isfile(file):
            return  # the config's schedule came back with the engine's state
        scheduler.load_state_dict(torch.load(file, map_location="cpu", weights_only=True))

    # ------------------------------------------------------------------ evaluation before training
    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """At ZeRO-3, a model whose parameters are sharded (``from_pretrained``) evaluates through an inference engine."""
        if self._engine() is None and _is_partitioned(self.model):
            build_inference_engine(self.model, inference_config(self.args.slipstream_config, self.model))
        return super().evaluation_loop(*args, **kwargs)


class SlipstreamTrainer(SlipstreamTrainerMixin, Trainer):
    """``Trainer`` with the model trained by a Slipstream engine built from ``args.deepspeed``."""


_switched: dict[type, type] = {
    SlipstreamTrainer: SlipstreamTrainer,
    Trainer: SlipstreamTrainer,
    TrainingArguments: SlipstreamTrainingArguments,
}


def slipstream_trainer(trainer_cls: type, arguments_cls: type) -> tuple[type, type]:
    """Any ``Trainer`` subclass and its arguments class, on Slipstream: the one-line switch for TRL's trainers and the rest.

    ``SFTTrainer, SFTConfig = slipstream_trainer(SFTTrainer, SFTConfig)`` (likewise ``DPOTrainer`` /
    ``DPOConfig``, ``Seq2SeqTrainer`` / ``Seq2SeqTrainingArguments``): each returned class is the
    host's own with Slipstream's overrides in front, so everything the subclass adds still runs.
    The same classes come back for the same input, so ``isinstance`` checks keep working.
    """
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, Trainer)):
        raise TypeError(f"slipstream_trainer: {trainer_cls!r} is not a transformers.Trainer subclass")
    if not (isinstance(arguments_cls, type) and issubclass(arguments_cls, TrainingArguments)):
        raise TypeError(f"slipstream_trainer: {arguments_cls!r} is not a transformers.TrainingArguments subclass")
    if trainer_cls not in _switched:
        _switched[trainer_cls] = _module_level(type(_free_name(trainer_cls), (SlipstreamTrainerMixin, trainer_cls), {}))
    if arguments_cls not in _switched:
        switched = type(_free_name(arguments_cls), (SlipstreamArgumentsMixin, arguments_cls), {})
        _switched[arguments_cls] = _module_level(dataclasses.dataclass(switched))
    return _switched[trainer_cls], _switched[arguments_cls]


def _free_name(cls: type) -> str:
    name, n = f"Slipstream{cls.__name__}", 1
    while name in globals():  # another host class of the same name already switched
        n += 1
        name = f"Slipstream{cls.__name__}{n}"
    return name


def _module_level(cls: type) -> type:
    """Made findable by pickle (the Trainer saves its arguments with ``torch.save``)."""
    cls.__module__, cls.__qualname__ = __name__, cls.__name__
    globals()[cls.__name__] = cls
    return cls


def _is_partitioned(model: torch.nn.Module) -> bool:
    return any(p.numel() > 0 and p.untyped_storage().nbytes() == 0 for p in model.parameters())
