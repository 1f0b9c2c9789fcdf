"""What a pipeline needs from the config, read and checked once (before any rank builds anything)."""

from __future__ import annotations

import dataclasses

from slipstream.engine.config import MeshSizes, SlipstreamConfig
from slipstream.engine.parallel.pipeline import schedules


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """``pipeline.*`` and the batch triad, as the cut and the schedule use them."""

    stages: int  # pipeline ranks (pipeline.stages)
    schedule: str
    micro_batches: int  # gradient_accumulation_steps: one window is one schedule
    virtual_stages: int
    partition: str  # parameters | uniform | profile | type:<regex>
    micro_batch_size: int  # for the profiled partition's synthetic batch
    twin_check: bool
    timed: bool  # wall_clock_breakdown: every rank's step timed from one common start (a barrier and a MAX per step)

    @classmethod
    def from_config(cls, cfg: SlipstreamConfig, sizes: MeshSizes) -> PipelineOptions | None:
        """None without a pipeline; :class:`ConfigError` naming the key for a schedule that cannot run."""
        p = sizes.size("pp")
        if p == 1:
            return None
        pipe = cfg.pipeline
        schedules.check(pipe.schedule, p, cfg.gradient_accumulation_steps, pipe.virtual_stages)
        return cls(
            p,
            pipe.schedule,
            cfg.gradient_accumulation_steps,
            pipe.virtual_stages,
            pipe.partition,
            cfg.train_micro_batch_size_per_gpu,
            cfg.twin_check,
            cfg.wall_clock_breakdown,
        )
