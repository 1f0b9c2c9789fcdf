"""Activation checkpointing, the last step of ``parallelize``: on the blocks this rank holds, as they were cut.

[Note: why last] Checkpointing replaces a block's ``forward`` on the instance. Applied after the
pipeline cut, tensor and sequence parallelism, it wraps exactly the blocks this rank runs, in their
final form, and ``number_checkpoints`` counts this rank's blocks (a later pipeline stage checkpoints
its own first blocks, not none). The classes are checked on the whole model before anything is cut.
"""

from __future__ import annotations

import dataclasses

import torch

from slipstream import checkpointing
from slipstream.engine.config import ConfigError, SlipstreamConfig
from slipstream.engine.parallel.mesh import Mesh
from slipstream.utils.logging import get_logger, log_rank0

logger = get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class ActivationOptions:
    """``activation_checkpointing``: the defaults of ``slipstream.checkpointing.checkpoint`` and the classes to wrap."""

    defaults: checkpointing.CheckpointOptions
    module_classes: tuple[str, ...]
    number_checkpoints: int | None

    @classmethod
    def from_config(cls, cfg: SlipstreamConfig, model: torch.nn.Module, device_type: str) -> ActivationOptions:
        """:class:`ConfigError` naming ``module_classes`` when the model has no module of a class."""
        section = cfg.activation_checkpointing
        if section.cpu_checkpointing and device_type == "cpu" and section.offload_path is None:
            log_rank0(
                logger,
                "activation_checkpointing.cpu_checkpointing: the device is the CPU, so saved activations already live in host memory; nothing to offload",
            )
        classes = tuple(section.module_classes or ())
        if section.offload_path is not None and not classes:
            log_rank0(
                logger,
                "activation_checkpointing.offload_path: applies to checkpointed regions only (module_classes, or your own slipstream.checkpointing.checkpoint calls)",
            )
        if not classes and section.number_checkpoints is not None:
            logger.warning("activation_checkpointing.number_checkpoints: only applies with module_classes; ignored")
        missing = set(classes) - {type(m).__name__ for m in model.modules()}
        if missing:
            found = sorted({type(m).__name__ for m in model.modules()})
            raise ConfigError(
                f"activation_checkpointing.module_classes: no module of class {', '.join(sorted(missing))} in the model "
                f"(its classes: {', '.join(found)})"
            )
        defaults = checkpointing.CheckpointOptions(
            cpu_checkpointing=section.cpu_checkpointing,
            use_reentrant=section.use_reentrant,
            synchronize_checkpoint_boundary=section.synchronize_checkpoint_boundary,
            offload_path=section.offload_path,
        )
        return cls(defaults, classes, section.number_checkpoints if classes else None)


def checkpoint_activations(model: torch.nn.Module, mesh: Mesh, options: ActivationOptions) -> list[str] | None:
    """Set the checkpoint defaults and wrap this rank's modules of ``module_classes``; their names (None: no classes).

    Not strict: the classes were found in the whole model (``from_config``); a pipeline stage may hold none of one.
    """
    checkpointing.configure(options.defaults)
    if not options.module_classes:
        return None
    names = checkpointing.apply_activation_checkpointing(
        model, options.module_classes, options.number_checkpoints, options.defaults.cpu_checkpointing, strict=False
    )
    log_rank0(
        logger,
        "activation checkpointing: %d modules (%s%s)",
        len(names),
        ", ".join(names[:3]),
        ", ..." if len(names) > 3 else "",
    )
    return names
