"""Every parallelism's options, built from the config once, before anything is built.

Each parallelism owns a frozen options class next to its code (``pipeline/options.py``,
``expert/options.py``, ``tensor/options.py``, ``sequence/options.py``, ``activations.py``, ``tiling/``, ``compiling.py``) whose
``from_config`` raises :class:`ConfigError` naming the key itself; this record only gathers them.
"""

from __future__ import annotations

import dataclasses

import torch

from slipstream.engine.config import MeshSizes, SlipstreamConfig
from slipstream.engine.parallel.activations import ActivationOptions
from slipstream.engine.parallel.compiling import CompileOptions
from slipstream.engine.parallel.expert.options import ExpertOptions
from slipstream.engine.parallel.pipeline.options import PipelineOptions
from slipstream.engine.parallel.sequence.options import SequenceOptions
from slipstream.engine.parallel.tensor.options import TensorOptions
from slipstream.engine.parallel.tiling import TilingOptions


@dataclasses.dataclass(frozen=True)
class ParallelOptions:
    """What ``parallelize`` does, step by step; ``None``: that parallelism is off."""

    presharded: bool  # built under zero.Init: the initial sync leaves its (already sharded) parameters alone
    pipeline: PipelineOptions | None
    experts: ExpertOptions | None
    tensor: TensorOptions | None
    sequence: SequenceOptions | None
    activations: ActivationOptions
    tiling: TilingOptions | None
    compile: CompileOptions | None

    @classmethod
    def from_config(
        cls,
        cfg: SlipstreamConfig,
        sizes: MeshSizes,
        model: torch.nn.Module,
        *,
        presharded: bool,
        optimizer_built: bool,
        device_type: str,
    ) -> ParallelOptions:
        return cls(
            presharded=presharded,
            pipeline=PipelineOptions.from_config(cfg, sizes),
            tensor=TensorOptions.from_config(cfg, sizes, presharded),
            sequence=SequenceOptions.from_config(cfg, sizes, model),
            experts=ExpertOptions.from_config(sizes, optimizer_built),
            activations=ActivationOptions.from_config(cfg, model, device_type),
            tiling=TilingOptions.from_config(cfg, sizes, model, presharded),
            compile=CompileOptions.from_config(cfg, sizes, model),
        )
