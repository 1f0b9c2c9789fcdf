"""``parallelize``: every parallelism applied to an unchanged model, in one fixed order.

[Note: the order] (torchtitan's ``parallelize_llama`` shape) 1. one world-wide initial weight sync
(``weights.py``); 2. the pipeline cut (this rank's blocks; the rest become pass-throughs);
3. experts (this rank's experts, dispatch by all-to-all); 4. tensor (+ sequence) parallel, which
swaps leaves inside the blocks that remain, after which the pipeline finds its tied weights again;
5. a dropout stream per pipeline stage and sequence shard (``rng.py``, after tp synced its ranks');
6. Ulysses / ring attention and the engine's input sharding; 7. the long-context tilings (the LM
head + loss and the MLPs over token tiles, ``tiling/``) on the modules as they now are;
8. ``torch.compile`` on each block's forward as it now is (``compiling.py``); 9. activation
checkpointing on the blocks as they now are, around their compiled forwards. Each step is ``(model, mesh, options) -> part | None`` and reads only what
the steps before it left; the twin checks run inside the steps that cut the model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from slipstream.checkpointing import remove_activation_checkpointing
from slipstream.engine.config.base import ConfigError
from slipstream.engine.parallel.activations import checkpoint_activations
from slipstream.engine.parallel.compiling import CompiledBlocks, CompileOptions, compile_blocks
from slipstream.engine.parallel.expert import ExpertPlan, parallelize_experts
from slipstream.engine.parallel.mesh import Mesh
from slipstream.engine.parallel.options import ParallelOptions
from slipstream.engine.parallel.pipeline import Pipeline, parallelize_pipeline
from slipstream.engine.parallel.rng import separate_slices
from slipstream.engine.parallel.sequence import Sharder, parallelize_attention
from slipstream.engine.parallel.tensor import TensorParallel, parallelize_tensor
from slipstream.engine.parallel.tiling import Tiling, parallelize_tiling
from slipstream.engine.parallel.weights import sync_initial_weights
from slipstream.utils.placement import placement_of


@dataclasses.dataclass
class Parallelized:
    """What ``parallelize`` made of the model: each part (None when off) and what the engine needs of them.

    Set once, except ``compiled``, which ``engine.compile`` replaces."""

    model: torch.nn.Module
    pipeline: Pipeline | None
    experts: ExpertPlan | None
    tensor: TensorParallel | None
    sequence: Sharder | None
    tiling: Tiling | None
    original_names: Mapping[int, str]  # id of each parameter before any cut -> its name
    mesh: Mesh
    options: ParallelOptions
    compiled: CompiledBlocks | None = None

    @property
    def spread(self) -> bool:
        """Whether ranks hold different parts of the model (pipeline stages, tensor pieces, experts)."""
        if self.pipeline is not None or self.tensor is not None or self.experts is not None:
            return True
        return any(placement_of(p) is not None for p in self.model.parameters())

    def param_groups(self, user: Iterable[Any] | None) -> Iterable[Any]:
        """The optimizer's parameter groups: the user's (``model_parameters``, built on the uncut model) moved onto
        the parameters now in the model, by name, and each group split into its dense and expert part."""
        if user is None:
            groups: Iterable[Any] = self.model.parameters()
        else:
            groups = list(user)
            if self.spread:
                groups = _remap(groups, self.original_names, self.model)
        if self.experts is None:
            return groups
        items = list(groups)
        return self.experts.split(items if items and isinstance(items[0], dict) else [{"params": items}])

    def rebind_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """A user's optimizer instance, built on the uncut model, moved onto the parameters now in it (by name, in place).

        [Note: an optimizer built before the cut] Hosts build their optimizer before the engine
        exists (the Trainer's ``create_optimizer``), so under tensor or pipeline parallelism it
        holds the full weights the cut replaced. Left alone, those would get no gradient and the
        shards none of its updates: training would run and be silently wrong.
        """
        if not self.spread:
            return
        if optimizer.state:
            raise ConfigError(
                "optimizer: already has state, but the parallelisms replaced the parameters it holds; pass a fresh "
                "optimizer (or a callable params -> optimizer)"
            )
        for group in optimizer.param_groups:
            group["params"] = _remap(list(group["params"]), self.original_names, self.model)

    def expert_tokens(self) -> tuple[tuple[int, ...], ...]:
        """Per experts module, the tokens each local expert received since the last call (for the step record)."""
        return self.experts.token_counts() if self.experts is not None else ()

    def compile(self, options: CompileOptions) -> CompiledBlocks | None:
        """Compile the blocks now (``engine.compile``): checkpointing comes off and goes back on around the
        compiled forwards, the order ``parallelize`` gives them. A second call recompiles with ``options``."""
        remove_activation_checkpointing(self.model)
        if self.compiled is not None:
            self.compiled.close()
        self.compiled = compile_blocks(self.model, options, _loss_tiled(self.tiling))
        checkpoint_activations(self.model, self.mesh, self.options.activations)
        return self.compiled

    def close(self) -> None:
        """Every part's hooks off; the model's own attention and forwards back (checkpointing first, the last
        applied). The cut itself stays."""
        remove_activation_checkpointing(self.model)
        for part in (self.compiled, self.tiling, self.sequence, self.pipeline, self.tensor, self.experts):
            if part is not None:
                part.close()


def parallelize(model: torch.nn.Module, mesh: Mesh, options: ParallelOptions) -> Parallelized:
    """Apply every parallelism ``options`` turns on, in the order of [Note: the order]. Collective over the world."""
    sync_initial_weights(model, parameters=not options.presharded)
    original = {id(p): n for n, p in model.named_parameters()}
    pipeline = parallelize_pipeline(model, mesh, options.pipeline)
    experts = parallelize_experts(model, mesh, options.experts)
    tensor = parallelize_tensor(model, mesh, options.tensor, experts)
    if pipeline is not None:
        pipeline.settle()  # tied weights and stand-ins found again after tensor parallel swapped modules
    separate_slices(*(mesh.rank_of(axis) for axis in ("pp", "cp", "sp")))
    sequence = parallelize_attention(model, mesh, options.sequence, pipeline, experts)
    tiling = parallelize_tiling(model, mesh, options.tiling)
    compiled = compile_blocks(model, options.compile, _loss_tiled(tiling))
    checkpoint_activations(model, mesh, options.activations)
    return Parallelized(model, pipeline, experts, tensor, sequence, tiling, original, mesh, options, compiled)


def _loss_tiled(tiling: Tiling | None) -> bool:
    return tiling is not None and tiling.logits is not None


def _remap(params: list[Any], original: Mapping[int, str], model: torch.nn.Module) -> list[Any]:
    """Groups built before ``initialize`` (decay / no-decay), moved onto the parameters the parallelisms put in
    their place, by name: a tensor-parallel shard for its full weight, nothing for a weight another pipeline
    stage or expert rank holds. A tensor that never was a parameter is left for the strategy to refuse."""
    current = dict(model.named_parameters())
    current_ids = {id(p) for p in current.values()}

    def mapped(p: Any) -> Any:
        if id(p) in current_ids or id(p) not in original:
            return p
        return current.get(original[id(p)])

    if params and isinstance(params[0], dict):
        groups = []
        for group in params:
            members = group["params"] if isinstance(group["params"], (list, tuple)) else [group["params"]]
            kept = [q for q in map(mapped, members) if q is not None]
            if kept:
                groups.append({**group, "params": kept})
        return groups
    return [q for q in map(mapped, params) if q is not None]
