"""Long context beyond sharding (``long_context``): the LM head + loss and the MLPs run over token tiles.

Once attention is sharded (Ulysses, ring), what bounds the sequence is the rest of the step: the
``[tokens × vocab]`` logits and their gradient, and the MLPs' ``[tokens × intermediate]``
activations. Both are computed here one tile of ``tile_tokens`` at a time and recomputed in the
backward (``tiles.py``), with results equal to the untiled model's; the step after Ulysses /
context parallel in ``parallelize``, so the tiles see the modules as the parallelisms left them
(tensor parallel's vocabulary-sharded head, its sharded MLP linears).
"""

from __future__ import annotations

import dataclasses

import torch

from slipstream.engine.config import ConfigError, MeshSizes, SlipstreamConfig
from slipstream.engine.parallel.mesh import Mesh
from slipstream.engine.parallel.tiling.logits import DeferredLogits, TiledLogits, head_vocab, is_causal_lm_loss
from slipstream.engine.parallel.tiling.mlp import TiledMLP, tile_mlps
from slipstream.utils.logging import get_logger, log_rank0

logger = get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class TilingOptions:
    """``long_context``: tokens per tile of the head + loss and of the MLPs (None: that tiling is off)."""

    logits_tile: int | None
    mlp_tile: int | None
    mlp_classes: tuple[str, ...] | None
    presharded: bool

    @classmethod
    def from_config(
        cls, cfg: SlipstreamConfig, sizes: MeshSizes, model: torch.nn.Module, presharded: bool
    ) -> TilingOptions | None:
        """None when both are off; :class:`ConfigError` naming the key for a model or mesh the tiles cannot serve."""
        section = cfg.long_context
        logits, mlp = section.tiled_logits, section.tiled_mlp
        if not logits.enabled and not mlp.enabled:
            return None
        units = set(cfg.zero_optimization.stage3_unit_modules or ()) if cfg.zero_optimization.stage == 3 else set()
        if logits.enabled:
            _check_head(model, units)
        classes = tuple(mlp.module_classes) if mlp.module_classes else None
        if mlp.enabled:
            if units & set(classes or ()):
                raise ConfigError(
                    f"long_context.tiled_mlp.module_classes: {sorted(units & set(classes or ()))} are also ZeRO-3 units "
                    "(zero_optimization.stage3_unit_modules); a tiled module must sit inside a unit, not be one"
                )
            if presharded and not classes:
                raise ConfigError(
                    "long_context.tiled_mlp: the model was built under zero.Init, so its MLPs cannot be probed here; name "
                    "their class in long_context.tiled_mlp.module_classes"
                )
        return cls(
            logits.tile_tokens if logits.enabled else None,
            mlp.tile_tokens if mlp.enabled else None,
            classes,
            presharded,
        )


def _check_head(model: torch.nn.Module, units: set[str]) -> None:
    name = type(model).__name__
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is None or head_vocab(head) is None:
        raise ConfigError(
            f"long_context.tiled_logits: {name} has no output embeddings with out_features (get_output_embeddings(), an "
            "nn.Linear LM head); the tiles need the head to defer"
        )
    loss = getattr(model, "loss_function", None)
    if not is_causal_lm_loss(loss):
        raise ConfigError(
            f"long_context.tiled_logits: {name}'s loss is {getattr(loss, '__name__', type(loss).__name__)}, not "
            "transformers' ForCausalLMLoss; the tiles compute the causal-LM loss only"
        )
    if type(head).__name__ in units:
        raise ConfigError(
            f"long_context.tiled_logits: the head {type(head).__name__} is a ZeRO-3 unit (zero_optimization.stage3_unit_modules); leave it in the root unit"
        )


@dataclasses.dataclass
class Tiling:
    """The tilings applied to a model; ``close`` restores its forwards and loss."""

    logits: TiledLogits | None
    mlp: TiledMLP | None

    def close(self) -> None:
        for part in (self.logits, self.mlp):
            if part is not None:
                part.close()


def parallelize_tiling(model: torch.nn.Module, mesh: Mesh, options: TilingOptions | None) -> Tiling | None:
    """Tile the head + loss and the MLPs as ``options`` say (None: off)."""
    if options is None:
        return None
    logits = mlp = None
    if options.logits_tile is not None:
        logits = TiledLogits(model, model.get_output_embeddings(), options.logits_tile)
        log_rank0(logger, "long_context: the LM head and loss run over tiles of %d tokens", options.logits_tile)
    if options.mlp_tile is not None:
        mlp = tile_mlps(model, options.mlp_classes, options.mlp_tile, probe=not options.presharded)
        log_rank0(
            logger,
            "long_context: %d MLPs run over tiles of %d tokens (%s, ...)",
            len(mlp.names),
            options.mlp_tile,
            mlp.names[0],
        )
    return Tiling(logits, mlp)


__all__ = ["DeferredLogits", "Tiling", "TilingOptions", "parallelize_tiling"]
