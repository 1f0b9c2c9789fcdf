"""The Engine: forward/backward/step orchestration around an unchanged user model.

No sharding logic lives here. The engine scales the loss, counts micro-steps, and at each
accumulation boundary asks its :class:`ShardingStrategy` to finish the gradient reduction, reads
the global norm (which doubles as the fp16 overflow check), clips, steps and schedules.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from slipstream.accelerator import Accelerator
from slipstream.comm import comms_log
from slipstream.comm.abort import tells_peers_on_failure
from slipstream.engine.checkpoint.manager import CheckpointManager
from slipstream.engine.checkpoint_calls import CheckpointCalls
from slipstream.engine.config import SlipstreamConfig
from slipstream.engine.data import DistributedDataLoader
from slipstream.engine.model_save import ModelWeights, SavesWeights
from slipstream.engine.monitor import StepRecord, TrainingMonitor
from slipstream.engine.no_optimizer import MISSING_OPTIMIZER, NoOptimizer
from slipstream.engine.optimizer_step import OptimizerStep
from slipstream.engine.parallel.calls import call_model
from slipstream.engine.parallel.compiling import CompileOptions
from slipstream.engine.parallel.mesh import Mesh
from slipstream.engine.parallel.parallelize import Parallelized
from slipstream.engine.parallel.pipeline import Pipeline
from slipstream.engine.precision import DTYPES, LossScaler
from slipstream.engine.runners import StepRunner, Windows, mean_over_dp
from slipstream.engine.zero.strategy import ShardingStrategy
from slipstream.errors import UsageError
from slipstream.ops import large_blocks
from slipstream.utils.logging import get_logger

logger = get_logger(__name__)

# Open engines by model; weak both ways (an engine holds its model, so a strong value would keep the key alive).
_engine_of: weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref[Engine]] = weakref.WeakKeyDictionary()


def engine_of(module: torch.nn.Module) -> Engine | None:
    """The open engine built over ``module``, if any (``initialize`` hands a model over from it)."""
    ref = _engine_of.get(module)
    return ref() if ref is not None else None


class Engine(SavesWeights, CheckpointCalls, torch.nn.Module):
    """Wraps ``module``; use ``loss = engine(batch); engine.backward(loss); engine.step()``.

    Built by ``initialize`` from what each of its steps made: the parallelized model (``parallel``),
    the ZeRO ``strategy`` and the step ``runner`` of its mode (runners/base.py); the Engine keeps the
    loop's state and delegates, with no branch on the mode.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        config: SlipstreamConfig,
        mesh: Mesh,
        parallel: Parallelized,
        strategy: ShardingStrategy,
        runner: StepRunner,
        monitor: TrainingMonitor,
        loss_scaler: LossScaler,
        accelerator: Accelerator,
        lr_scheduler: Any = None,
        training_dataloader: DistributedDataLoader | None = None,
    ) -> None:
        super().__init__()
        self.module, self.config, self.mesh, self.parallel, self.strategy = module, config, mesh, parallel, strategy
        self.runner, self.monitor, self.loss_scaler, self.accelerator = runner, monitor, loss_scaler, accelerator
        self.world_size, self.lr_scheduler, self.training_dataloader = (
            mesh.sizes.world,
            lr_scheduler,
            training_dataloader,
        )
        self.global_steps = self.micro_steps = self.skipped_steps = 0
        self.global_samples = 0  # counted over dp (ranks that share a dp coordinate see the same samples)
        self._no_sync = self._backward_since_step = self._step_applied = False
        self._global_grad_norm: float | torch.Tensor | None = None  # a device scalar until someone reads it
        self._forced_boundary: bool | None = None  # integrations API: set_gradient_accumulation_boundary
        self._window_micro_steps = 0  # micro-steps since the last boundary (forced boundaries included)
        self.weights = ModelWeights(module, strategy, parallel.spread, DTYPES[config.precision])
        self.checkpoints = CheckpointManager(config.checkpoint)
        # As DeepSpeed: fp16 always skips steps with non-finite gradients; bf16 unless told not to.
        overflow = config.fp16.enabled or (config.bf16.enabled and config.bf16.check_grad_overflow)
        self._update = OptimizerStep(
            strategy,
            loss_scaler,
            config.gradient_clipping,
            overflow,
            self.checkpoints.before_update,
            accelerator.runs_ahead_of_host,
        )
        self.checkpoint_states: dict[str, Any] = {}  # extra objects saved through state_dict()/load_state_dict()
        self._windows = Windows(training_dataloader, config.gradient_accumulation_steps)  # train_batch/eval_batch
        self.resumed_from: str | None = None  # checkpoint.auto_resume: what was loaded, and its client state
        self.resumed_client_state: dict[str, Any] | None = None
        if config.checkpoint.auto_resume:  # the fault-tolerant launcher restarts jobs with this on
            self.resumed_from, self.resumed_client_state = self.checkpoints.resume(self)
        _engine_of[module] = weakref.ref(self)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.strategy.optimizer

    @property
    def pipeline(self) -> Pipeline | None:
        """This rank's pipeline stages and their schedule (None without a pipeline)."""
        return self.parallel.pipeline

    # ------------------------------------------------------------------ training loop
    @tells_peers_on_failure("engine(...)")
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        comms_log.step = self.global_steps  # a timed-out collective names this step (also after a resume)
        return self.runner.forward(args, kwargs, self.global_steps)

    @tells_peers_on_failure("engine.backward")
    def backward(self, loss: Any, retain_graph: bool = False, scale_wrt_gas: bool = True) -> Any:
        """Scale ``loss`` for accumulation and fp16, backpropagate, start gradient communication.

        ``scale_wrt_gas=False``: the caller already divided the loss by the accumulation steps (as
        the Hugging Face Trainer does), so only the fp16 loss scale is applied.
        """
        self._require_optimizer("engine.backward")
        boundary = self.is_gradient_accumulation_boundary()
        if boundary and self._backward_since_step:
            raise UsageError(
                "engine.backward: called twice at an accumulation boundary without engine.step() in between; "
                "call engine.step() after every engine.backward()"
            )
        if boundary and self._no_sync:
            raise UsageError(
                "engine.backward: this micro-step completes an accumulation window (gradient_accumulation_steps="
                f"{self.gradient_accumulation_steps()}), so its gradients must be reduced across ranks; run it "
                "outside engine.no_sync()"
            )
        accumulation = self.gradient_accumulation_steps() if scale_wrt_gas else 1
        self.runner.backward(loss, self.loss_scaler.scale, accumulation, boundary, retain_graph, self.global_steps)
        self._backward_since_step = True
        return loss

    @tells_peers_on_failure("engine.train_batch")
    def train_batch(self, data_iter: Any = None) -> torch.Tensor:
        """DeepSpeed's call: ``gradient_accumulation_steps`` micro-batches from ``data_iter`` and one step; the global mean loss."""
        losses = []
        for batch in self._windows.draw(data_iter, "train_batch"):
            loss = self.runner.loss_of(call_model(self, batch))
            self.backward(loss)
            self.step()
            losses.append(loss)  # a pipeline's are known after the window's last backward
        return mean_over_dp([float(loss.item()) for loss in losses], self.mesh)

    @tells_peers_on_failure("engine.eval_batch")
    def eval_batch(self, data_iter: Any = None) -> torch.Tensor:
        """Forward only over ``gradient_accumulation_steps`` micro-batches; the global mean loss, on every rank."""
        batches = self._windows.draw(data_iter, "eval_batch")
        comms_log.step = self.global_steps
        return mean_over_dp(self.runner.evaluate(batches, self.global_steps), self.mesh)

    @tells_peers_on_failure("engine.step")
    def step(self) -> None:
        """Optimizer step at an accumulation boundary; between boundaries only counts the micro-step."""
        self._require_optimizer("engine.step")
        if not self._backward_since_step:
            raise UsageError("engine.step: no engine.backward() since the last step")
        boundary = self.is_gradient_accumulation_boundary()
        self._step_applied = False
        if boundary:
            with self.monitor.timers("step"):
                self._optimizer_step()
        self._backward_since_step = False
        self.micro_steps += 1
        self._window_micro_steps = 0 if boundary else self._window_micro_steps + 1
        self.global_samples += self.train_micro_batch_size_per_gpu() * self.mesh.size("dp")
        if boundary:
            self._report_progress()
            if self.checkpoints.due(self.global_steps):  # checkpoint.interval
                self.save_checkpoint(self.config.checkpoint.save_dir)
            if self.checkpoints.snapshot_due(self.global_steps):  # checkpoint.in_memory_interval
                self.checkpoints.snapshot(self.checkpoint_target(), self._pin(), self.accelerator.synchronize)

    def _optimizer_step(self) -> None:
        result = self._update(self.lr_scheduler, self.global_steps)
        self._global_grad_norm, self._step_applied = result.grad_norm, result.applied
        self.skipped_steps += 0 if result.applied else 1
        self.global_steps += 1
        large_blocks.trim()  # the step's freed large blocks that it did not take again (ops/large_blocks.py)
        if self.config.comms_logger.enabled and self.config.comms_logger.verbose:
            logger.info(comms_log.summary())
        comms_log.next_step()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Micro-steps that must not complete an accumulation window (like DDP's ``no_sync``).

        Stages 0-2 already communicate only at the boundary; stage 3 still reduce-scatters each
        micro-step (it keeps no full gradient). A boundary backward inside it is an error.
        """
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def _report_progress(self) -> None:
        """Metrics to the writers every step, the progress line every ``steps_per_print`` (engine/monitor)."""
        lrs = self.get_lr()
        self.monitor.on_step(
            StepRecord(
                global_steps=self.global_steps,
                global_samples=self.global_samples,
                train_batch_size=self.train_batch_size(),
                lr=lrs[0] if lrs else None,
                grad_norm=self._global_grad_norm,
                loss_scale=self.loss_scale(),
                dynamic_loss_scale=self.loss_scaler.dynamic,
                expert_tokens=self.parallel.expert_tokens(),
                compile=self.parallel.compiled.on_step() if self.parallel.compiled is not None else None,
            )
        )

    def compile(
        self,
        backend: str | None = None,
        compile_kwargs: dict[str, Any] | None = None,
        module_classes: list[str] | None = None,
    ) -> None:
        """``torch.compile`` each repeated block now (DeepSpeed's ``engine.compile``), as the ``compile`` section does
        at ``initialize``: the engine's hooks stay outside the graphs (parallel/compiling.py). Unset arguments take
        the section's values; a second call recompiles with the new ones. :class:`ConfigError` on a bad backend."""
        self.parallel.compile(
            CompileOptions.build(
                self.config.compile,
                self.module,
                self.mesh.size("tp"),
                "engine.compile",
                backend,
                compile_kwargs,
                module_classes,
            )
        )

    @property
    def is_compiled(self) -> bool:
        return self.parallel.compiled is not None

    # ------------------------------------------------------------------ accessors
    def is_gradient_accumulation_boundary(self) -> bool:
        if self._forced_boundary is not None:  # set_gradient_accumulation_boundary()
            return self._forced_boundary
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def train_batch_size(self) -> int:
        return int(self.config.train_batch_size)

    def train_micro_batch_size_per_gpu(self) -> int:
        return int(self.config.train_micro_batch_size_per_gpu)

    def gradient_accumulation_steps(self) -> int:
        return int(self.config.gradient_accumulation_steps)

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self, as_tensor: bool = False) -> float | torch.Tensor | None:
        """Global gradient L2 norm of the last optimizer step, before clipping (None before the first).

        A float waits for the device ([Note: the step does not wait for the device]); ``as_tensor``: a scalar
        tensor, on the device where the step never read it, for a caller that reads it later (the Trainer's log)."""
        norm = self._global_grad_norm
        if norm is None or not as_tensor:
            return None if norm is None else float(norm)
        return norm if isinstance(norm, torch.Tensor) else torch.tensor(norm)

    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    def close(self, for_new_engine: bool = False) -> None:
        """Wait for a background checkpoint save, detach the engine's hooks, close the metric writers.

        ``for_new_engine`` (``initialize`` over the same model; collective): an engine without an
        optimizer at plain ZeRO-3 (a model loaded straight into shards) leaves its shards
        partitioned for the next engine instead of gathering the whole model.
        """
        self.checkpoints.wait()
        hand_over = for_new_engine and not self.has_optimizer() and self.mesh.sizes.dp == self.mesh.sizes.world
        if not (hand_over and self.strategy.leave_partitioned()):
            self.strategy.close()
        self.monitor.close()
        self.parallel.close()  # every parallelism's hooks; the model's own attention back
        if engine_of(self.module) is self:
            del _engine_of[self.module]

    # ------------------------------------------------------------------ integrations API (issue 15)
    # [Note: DeepSpeed's names] The Hugging Face Trainer, Accelerate and Lightning drive a DeepSpeed
    # engine through these calls; they keep DeepSpeed's names and meaning so those loops (and code
    # written against them) drive this engine unchanged. The saving calls live in model_save.py (SavesWeights).
    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Force the next ``backward``/``step`` to be (or not be) an accumulation boundary.

        The flag stays until set again, as in DeepSpeed (hosts set it before every micro-step, e.g.
        the Trainer forces a boundary on an epoch's last batch); ``None`` returns to counting.
        """
        self._forced_boundary = None if is_boundary is None else bool(is_boundary)

    def micro_steps_in_window(self) -> int:
        """Micro-steps whose gradients are accumulated but not yet applied (0 right after a boundary)."""
        return self._window_micro_steps

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` updated the weights (false between boundaries and after an fp16 overflow skip)."""
        return self._step_applied

    def has_optimizer(self) -> bool:
        return not isinstance(self.strategy.optimizer, NoOptimizer)

    def _require_optimizer(self, call: str) -> None:
        if not self.has_optimizer():
            raise UsageError(f"{call}: {MISSING_OPTIMIZER}")

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """DeepSpeed's switch: whether saving the model at stage 3 gathers full 16-bit weights."""
        return bool(self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save)

    def destroy(self) -> None:
        """DeepSpeed's name for :meth:`close`."""
        self.close()
