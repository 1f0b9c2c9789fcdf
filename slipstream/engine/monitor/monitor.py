"""What the run is doing: the ``steps_per_print`` line, metric writers, timers, throughput and MFU.

The engine calls a handful of methods (:meth:`TrainingMonitor.forward`, :meth:`on_loss`,
:meth:`timers`, :meth:`on_step`, :meth:`close`); everything else lives here. Nothing costs a device
synchronization unless it is asked for: the loss is summed on the device and read once per
optimizer step only when a writer or the progress line needs it; timers synchronize only with
``wall_clock_breakdown``. At each progress line every rank joins one tiny exchange that names a slow
rank or the first rank whose loss went non-finite (health.py).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from slipstream.comm import comms_log
from slipstream.comm.comms_log import CommRecord
from slipstream.engine.config import ConfigError, SlipstreamConfig
from slipstream.engine.monitor.flops import TransformerFlops, analytic_flops, flop_counter_mode
from slipstream.engine.monitor.health import RankHealth, WaitClock
from slipstream.engine.monitor.record import StepRecord
from slipstream.engine.monitor.writers import Writer, build_writers
from slipstream.utils.logging import get_logger

logger = get_logger(__name__)

# Dense peak TFLOP/s per device by name fragment, for MFU when flops_profiler.peak_tflops is unset
# (vendor datasheets: bf16/fp16 tensor cores without sparsity; fp32 without TF32).
_PEAKS = {
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
}


class TrainingMonitor:
    """One per engine; rank 0 prints and writes, every rank times and counts."""

    def __init__(
        self,
        config: SlipstreamConfig,
        module: torch.nn.Module,
        accelerator: Any,
        rank: int,
        world_size: int,
        traffic_by_axis: Callable[[list[CommRecord]], Mapping[str, int]] | None = None,
    ) -> None:
        """``traffic_by_axis``: a step's collectives → bytes per mesh axis (``Mesh.traffic``), read only for steps
        whose metrics are written."""
        self.config = config
        self.traffic_by_axis = traffic_by_axis
        self.rank, self.world_size = rank, world_size
        self.accelerator = accelerator
        self.timers = WaitClock(config.wall_clock_breakdown, accelerator.synchronize)
        self.health = RankHealth(rank, accelerator.device())  # slow and numerically sick ranks, named at progress lines
        _check_packages(config)
        self.writers: list[Writer] = build_writers(config) if rank == 0 else []
        profiler = config.flops_profiler
        self.peak_tflops = profiler.peak_tflops or _known_peak(accelerator, config.precision)
        self._recompute = profiler.recompute_fwd_factor  # hardware FLOPs = model FLOPs × (3 + this) / 3
        self.analytic: TransformerFlops | None = analytic_flops(module)
        self.measured_flops_per_token: float | None = None  # from the counter, for models without a config
        self._loss_sum: torch.Tensor | None = None
        self._losses = 0
        self._router_sum: torch.Tensor | None = None  # an MoE's balancing loss (the model's aux_loss) over the step
        self._routers = 0
        self._tokens = 0  # this rank's tokens since the last optimizer step
        self._seq_len: int | None = None
        self._step_start = time.perf_counter()
        self._window = _Window()
        self._profiling: Any = None  # the FlopCounterMode of an in-progress profile
        self._profiled = False
        self._profile_tokens = 0
        self.last: dict[str, float] = {}  # the latest step's metrics (tests and examples read them)
        self._bubble: tuple[float | None, float | None] | None = None  # pipeline: (measured, predicted) this rank
        self._overlapped: int | None = None  # pipeline: collectives overlapped with compute this step (DualPipeV pairs)

    # ------------------------------------------------------------------ engine calls
    @contextlib.contextmanager
    def forward(self, args: tuple[Any, ...], kwargs: dict[str, Any], global_step: int) -> Iterator[None]:
        """Around the model's forward: count the micro-batch's tokens, time it, count FLOPs when due."""
        training = torch.is_grad_enabled()  # evaluation forwards (no_grad) are not training throughput
        tokens = _token_tensor(args, kwargs) if training else None
        if tokens is not None:
            self._tokens += tokens.numel()
            self._seq_len = tokens.shape[-1]
        profiler = self.config.flops_profiler
        if training and profiler.enabled and not self._profiled and global_step + 1 >= profiler.profile_step:
            self._profiled = True  # forward and backward of this micro-batch, closed in on_loss
            self._profiling = flop_counter_mode(
                depth=max(profiler.module_depth, 1) if profiler.module_depth > 0 else 16
            )
            self._profiling.__enter__()
            self._profile_tokens = tokens.numel() if tokens is not None else 0
        count_forward = (
            training and tokens is not None and self.analytic is None and self.measured_flops_per_token is None
        )
        counter = flop_counter_mode() if count_forward and self._profiling is None else contextlib.nullcontext()
        with self.timers("forward"), counter:
            yield
        if count_forward and self._profiling is None:
            # No config to compute from: 3× the counted forward (backward costs twice the forward).
            self.measured_flops_per_token = 3 * counter.get_total_flops() / tokens.numel()

    def on_loss(self, loss: torch.Tensor, engine_step: int) -> None:
        """After each backward: sum the micro-batch loss on the device; finish a FLOP measurement."""
        value = loss.detach().float()
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._losses += 1
        if self._profiling is not None:
            mode, self._profiling = self._profiling, None
            mode.__exit__(None, None, None)
            self._finish_profile(mode, engine_step)

    def on_router_loss(self, value: torch.Tensor) -> None:
        """A training forward's balancing loss (the model's ``aux_loss``, before its coefficient), summed on the device."""
        value = value.detach().float()
        self._router_sum = value if self._router_sum is None else self._router_sum + value
        self._routers += 1

    def _take_router_loss(self) -> float | None:
        value = float(self._router_sum) / self._routers if self._router_sum is not None and self._routers else None
        self._router_sum, self._routers = None, 0
        return value

    def on_pipeline_step(
        self, measured: float | None, predicted: float | None, engine_step: int, overlapped: int | None = None
    ) -> None:
        """A pipeline schedule ran: this rank's idle time over compute time, what the schedule predicts for the same costs,
        and (schedules that pair micro-batches) how many collectives ran while the pair's other half computed."""
        self._bubble = (measured, predicted)
        self._overlapped = overlapped
        logger.debug(
            "step %d: pipeline bubble %.3f measured, %.3f predicted (rank %d)",
            engine_step,
            measured or 0.0,
            predicted or 0.0,
            self.rank,
        )

    def on_step(self, step: StepRecord) -> None:
        """At each optimizer step: metrics for the writers, the progress line every ``steps_per_print``."""
        now = time.perf_counter()
        step_time, self._step_start = now - self._step_start, now
        samples = step.train_batch_size
        tokens = self._tokens * self.world_size  # every rank trains on micro-batches of the same shape
        self._tokens = 0
        timers = self.timers.take()
        self._window.add(step_time, samples, tokens, timers)
        every = self.config.steps_per_print
        printing = bool(every) and step.global_steps % every == 0
        if every:  # someone will read it: the exchange at the progress line
            self.health.on_step(
                step.global_steps,
                self._loss_sum,
                self._losses,
                step.grad_norm,
                step.dynamic_loss_scale,
                self.timers.take_waited(),
            )
        verdicts = self.health.exchange(step.global_steps) if printing else []  # every rank; rank 0 logs them below
        if self.rank != 0 or not (self.writers or printing):
            self._loss_sum, self._losses = None, 0
            self._router_sum, self._routers = None, 0
            if printing:
                self._window = _Window()
            return
        loss = float(self._loss_sum) / self._losses if self._loss_sum is not None and self._losses else math.nan
        self._loss_sum, self._losses = None, 0
        metrics = self._metrics(step, loss, step_time, samples, tokens, timers)
        router = self._take_router_loss()
        if router is not None:
            metrics["router_loss"] = router
        self.last = metrics
        if self.writers:
            events = [(f"Train/Samples/{name}", value, step.global_samples) for name, value in metrics.items()]
            for writer in self.writers:
                writer.write(events)
                writer.flush()  # as DeepSpeed: a crashed run keeps its curves up to the last step
        if printing:
            logger.info(self._line(step, loss, router))
            for level, line in verdicts:
                logger.log(level, "%s", line)
            self._window = _Window()

    def close(self) -> None:
        if self._profiling is not None:
            self._profiling.__exit__(None, None, None)
            self._profiling = None
        for writer in self.writers:
            writer.close()
        self.writers = []

    # ------------------------------------------------------------------ numbers
    def flops_per_token(self) -> float | None:
        """Model FLOPs to train on one token at the current sequence length (see slipstream.estimator)."""
        if self.analytic is not None and self._seq_len:
            return self.analytic.per_token(self._seq_len)
        return self.measured_flops_per_token

    def _metrics(
        self, step: StepRecord, loss: float, step_time: float, samples: int, tokens: int, timers: dict[str, float]
    ) -> dict[str, float]:
        metrics = {"train_loss": loss, "lr": step.lr if step.lr is not None else math.nan}
        if step.grad_norm is not None:
            metrics["grad_norm"] = float(step.grad_norm)
        metrics["loss_scale"] = step.loss_scale
        metrics["samples_per_second"] = samples / step_time
        if tokens:
            metrics["tokens_per_second"] = tokens / step_time
        metrics["step_time_ms"] = step_time * 1e3
        for layer, counts in enumerate(step.expert_tokens):  # load balance of each MoE layer
            for expert, n in enumerate(counts):
                metrics[f"expert_tokens/layer{layer}/expert{expert}"] = float(n)
            mean = sum(counts) / len(counts) if counts else 0.0
            metrics[f"expert_balance/layer{layer}"] = max(counts) / mean if mean else math.nan
        for name, value in (step.compile or {}).items():  # cumulative: a rise in graph_breaks or recompiles is news
            metrics[f"compile/{name}"] = value
        if self._bubble is not None:
            measured, predicted = self._bubble
            if measured is not None:
                metrics["pipeline_bubble"] = measured
            if predicted is not None:
                metrics["pipeline_bubble_predicted"] = predicted
        if self._overlapped is not None:
            metrics["pipeline_overlapped_collectives"] = float(self._overlapped)
        flops = self.flops_per_token()
        if flops and tokens:
            metrics["tflops_per_device"] = flops * tokens / self.world_size / step_time / 1e12
            if self.peak_tflops:
                metrics["mfu"] = metrics["tflops_per_device"] / self.peak_tflops
                if self._recompute:
                    metrics["hfu"] = metrics["mfu"] * (3 + self._recompute) / 3
        metrics["peak_memory_MB"] = self.accelerator.max_memory_allocated() / 2**20
        if comms_log.last:
            metrics["comms_MB"] = sum(r.moved for r in comms_log.last) / 2**20
            for axis, moved in (self.traffic_by_axis(comms_log.last) if self.traffic_by_axis else {}).items():
                metrics[f"comms_MB/{axis}"] = (
                    moved / 2**20
                )  # which axis the step's traffic crossed (docs/monitoring.md)
        for name, seconds in timers.items():
            metrics[f"time_{name}_ms"] = seconds * 1e3
        return metrics

    def _line(self, step: StepRecord, loss: float, router: float | None = None) -> str:
        w = self._window
        parts = [f"step {step.global_steps}", f"loss {loss:.4f}"]
        if router is not None:
            parts.append(f"router loss {router:.4f}")
        parts.append(f"lr {step.lr if step.lr is not None else math.nan:.3g}")
        if step.grad_norm is not None:
            parts.append(f"grad norm {float(step.grad_norm):.3f}")
        if step.dynamic_loss_scale:
            parts.append(f"loss scale {step.loss_scale:g}")
        if w.tokens:
            parts.append(f"{w.tokens / w.seconds:.0f} tokens/s")
        parts.append(f"{w.samples / w.seconds:.1f} samples/s")
        parts.append(f"step {w.seconds / w.steps * 1e3:.0f} ms")
        flops = self.flops_per_token()
        if flops and w.tokens:
            tflops = flops * w.tokens / self.world_size / w.seconds / 1e12
            parts.append(f"{tflops:.3g} TFLOP/s/device")
            parts.append(
                f"MFU {tflops / self.peak_tflops:.1%}"
                if self.peak_tflops
                else "MFU n/a (set flops_profiler.peak_tflops)"
            )
            if self.peak_tflops and self._recompute:
                parts.append(f"HFU {tflops / self.peak_tflops * (3 + self._recompute) / 3:.1%}")
        parts.append(f"peak mem {self.accelerator.max_memory_allocated() / 2**20:.0f} MB")
        if step.compile:
            c = step.compile
            parts.append(
                f"compiled {c['graphs']:.0f} graphs ({c['graph_breaks']:.0f} breaks, {c['recompiles']:.0f} recompiles) in {c['seconds']:.1f} s"
            )
        if w.timers:
            parts.append("time/step " + " ".join(f"{n} {s / w.steps * 1e3:.1f}" for n, s in w.timers.items()) + " ms")
        if comms_log.last:
            ops: dict[str, list[float]] = {}
            for r in comms_log.last:
                entry = ops.setdefault(r.op, [0, 0.0])
                entry[0] += 1
                entry[1] += r.nbytes
            parts.append("comms " + ", ".join(f"{op} {n}× {b / 2**20:.1f} MiB" for op, (n, b) in sorted(ops.items())))
        return " | ".join(parts)

    def _finish_profile(self, mode: Any, step: int) -> None:
        if self.rank != 0:
            return
        total = mode.get_total_flops()
        report = self._profile_report(mode, total, step + 1)
        output = self.config.flops_profiler.output_file
        if output:
            Path(output).write_text(report + "\n")
            logger.info("flops profile of step %d written to %s", step + 1, output)
        else:
            logger.info("%s", report)

    def _profile_report(self, mode: Any, total: int, step: int) -> str:
        profiler = self.config.flops_profiler
        tokens = self._profile_tokens
        lines = [f"flops profile, step {step}, first micro-batch ({tokens} tokens on this rank):"]
        lines.append(
            f"  counted forward+backward: {total:,} FLOPs" + (f" = {total / tokens:,.0f} per token" if tokens else "")
        )
        formula = self.flops_per_token()
        if formula and tokens:
            lines.append(
                f"  model FLOPs per token by the formula 6N + 12·L·d_attn·s: {formula:,.0f} "
                f"(counted/formula {total / tokens / formula:.3f}; above 1 with activation recomputation)"
            )
        if profiler.detailed:
            counts = {name: sum(ops.values()) for name, ops in mode.get_flop_counts().items()}
            depth_limit = (
                profiler.module_depth
                if profiler.module_depth > 0
                else max((n.count(".") for n in counts), default=0) + 1
            )
            for depth in range(1, depth_limit + 1):
                level = sorted(
                    ((n, c) for n, c in counts.items() if n != "Global" and n.count(".") == depth - 1),
                    key=lambda x: -x[1],
                )
                if not level:
                    continue  # e.g. a ModuleList: never called itself
                top = ", ".join(f"{n} {c / total:.1%}" for n, c in level[: profiler.top_modules])
                lines.append(f"  depth {depth}, top {profiler.top_modules}: {top}")
        return "\n".join(lines)


class _Window:
    """Totals since the last progress line."""

    def __init__(self) -> None:
        self.steps, self.seconds, self.samples, self.tokens = 0, 0.0, 0, 0
        self.timers: dict[str, float] = {}

    def add(self, seconds: float, samples: int, tokens: int, timers: dict[str, float]) -> None:
        self.steps += 1
        self.seconds += seconds
        self.samples += samples
        self.tokens += tokens
        for name, value in timers.items():
            self.timers[name] = self.timers.get(name, 0.0) + value


def _token_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The token ids of a micro-batch: ``input_ids`` or the first integer tensor argument."""
    candidate = kwargs.get("input_ids")
    if isinstance(candidate, torch.Tensor):
        return candidate
    for value in (*args, *kwargs.values()):
        if (
            isinstance(value, torch.Tensor)
            and not value.is_floating_point()
            and value.dim() >= 1
            and value.dtype != torch.bool
        ):
            return value
    return None


def _known_peak(accelerator: Any, precision: str) -> float | None:
    name = accelerator.device_name()
    if accelerator.name != "cuda" or not name:
        return None
    return next((peaks[precision] for key, peaks in _PEAKS.items() if key in name), None)


def _check_packages(config: SlipstreamConfig) -> None:
    """Every rank fails alike on a writer whose package is missing (only rank 0 builds them)."""
    import importlib.util

    if config.wandb.enabled and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "wandb.enabled: the wandb package is not installed; pip install wandb, or set enabled to false"
        )
    if config.tensorboard.enabled and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("tensorboard.enabled: needs the tensorboard package; pip install tensorboard")
