"""Full model weights out of a sharded engine: a gathered state dict, and the file Hugging Face loads.

[Note: what a saved model holds] ``save_16bit_model`` writes what ``model.state_dict()`` of the
plain model would hold, in the training dtype: every parameter under its ``named_parameters()``
name (gathered from the shards at any stage) and every persistent buffer. Tied weights appear once,
as ``save_pretrained`` writes them; ``from_pretrained`` re-ties them. The file is safetensors or a
``torch.save`` of a plain tensor dict, so loading it never needs to unpickle objects.

Two ways to write it, both in checkpoint/formats/hf/ (this module is the engine's glue): one file gathered on rank 0
(:meth:`ModelWeights.save`, ``files.write_whole``), or Hugging Face's
sharded layout with every rank writing its own files and nothing gathered (:meth:`ModelWeights.save_sharded`,
checkpoint/formats/hf/parallel_save.py); a ``.safetensors`` name at world size > 1 takes the second by default.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
import torch.distributed as dist

from slipstream import comm
from slipstream.engine.checkpoint.formats.hf.files import write_whole
from slipstream.engine.checkpoint.formats.hf.parallel_save import ShardReport, write_sharded
from slipstream.engine.zero.strategy import ShardingStrategy
from slipstream.utils.pieces import ParamSlice, assemble


@dataclasses.dataclass(frozen=True)
class ModelWeights:
    """What writing the whole model needs from an engine, given explicitly: the module, its strategy, whether
    ranks hold different parts of it (tensor, pipeline or expert parallel) and the training dtype."""

    module: torch.nn.Module
    strategy: ShardingStrategy
    spread: bool
    dtype: torch.dtype

    def consolidated(self, dtype: torch.dtype | None, exclude_frozen: bool) -> dict[str, torch.Tensor] | None:
        """The strategy's fp32 gathered parameters, cast to ``dtype``, without frozen ones on request. Collective."""
        if self.spread:
            state = self.gather_spread(exclude_frozen)
            exclude_frozen = False  # each rank left out its own frozen parameters
        else:
            state = self.strategy.consolidated_state_dict()
        if state is None:
            return None
        if exclude_frozen:
            frozen = {name for name, p in self.module.named_parameters() if not p.requires_grad}
            state = {name: value for name, value in state.items() if name not in frozen}
        if dtype is not None:
            state = {name: value.to(dtype) for name, value in state.items()}
        return state

    def gather_spread(self, exclude_frozen: bool = False) -> dict[str, torch.Tensor] | None:
        """Whole fp32 parameters on rank 0 from every rank's saved slices (pieces under tp, stages under pp, experts under ep).

        [Note: assembling a spread model] Each rank sends what it would save in a checkpoint (each
        element of the model once: duplicates stay home) as (name, global shape, box, flat range) plus
        the values; rank 0 assembles every parameter as the checkpoint reader does. Names keep the
        order of the ranks (pipeline stages in order), each rank's in its model order. Collective.
        """
        frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad} if exclude_frozen else set()
        entries, values = [], []
        for owned in self.strategy.sharded_state():
            if owned.duplicate or owned.slice.name in frozen:
                continue
            value = owned.value.detach().float().reshape(-1).cpu()
            for lo, hi, s in owned.slice.split():  # a packed piece (tensor parallel) is one box per part
                entries.append(s.entry())
                values.append(value[lo:hi])
        mine = (entries, torch.cat(values) if values else torch.zeros(0))
        gathered = comm.gather_objects(mine, dst=0, tag="consolidated weights")
        if gathered is None:
            return None
        pieces: dict[str, list[tuple[ParamSlice, torch.Tensor]]] = {}
        for rank_entries, flat in gathered:
            offset = 0
            for entry in rank_entries:
                piece = ParamSlice.from_entry(entry)
                pieces.setdefault(piece.name, []).append((piece, flat[offset : offset + piece.numel]))
                offset += piece.numel
        return {name: assemble(parts[0][0].shape, parts, torch.float32) for name, parts in pieces.items()}

    def full_state(self, exclude_frozen: bool = False) -> dict[str, torch.Tensor] | None:
        """Parameters in the training dtype plus persistent buffers, on rank 0 (``None`` elsewhere). Collective."""
        from slipstream.engine.checkpoint.capture import persistent_buffers  # shared: what state_dict() holds

        state = self.consolidated(self.dtype, exclude_frozen)
        buffers = self._spread_buffers() if self.spread else persistent_buffers(self.module)
        if state is None or buffers is None:
            return None
        for name, buffer in buffers.items():
            state[name] = buffer.detach().cpu().clone()
        return {name: value.detach().cpu().contiguous() for name, value in state.items()}

    def _spread_buffers(self) -> dict[str, torch.Tensor] | None:
        """Persistent buffers by name from every rank (a pipeline stage holds only its own); rank 0's win. Collective."""
        from slipstream.engine.checkpoint.capture import persistent_buffers

        mine = {name: b.detach().cpu() for name, b in persistent_buffers(self.module).items()}
        gathered = comm.gather_objects(mine, dst=0, tag="persistent buffers")
        if gathered is None:
            return None
        buffers: dict[str, torch.Tensor] = {}
        for found in gathered:
            for name, value in found.items():
                buffers.setdefault(name, value)
        return buffers

    def save(
        self, save_dir: str | os.PathLike[str], filename: str, exclude_frozen: bool, sharded: bool | None = None
    ) -> bool:
        """``engine.save_16bit_model``: every rank returns True once the file (or the shards and their index) exists.

        ``sharded=None``: sharded for a ``.safetensors`` name when there are several ranks, else one file from rank 0. Collective.
        """
        if sharded is None:
            sharded = filename.endswith(".safetensors") and dist.is_initialized() and dist.get_world_size() > 1
        if sharded:
            self.save_sharded(save_dir, None, exclude_frozen, filename=filename)
            return True
        state = self.full_state(exclude_frozen)
        if state is not None:
            write_whole(Path(save_dir) / filename, state)
        if dist.is_initialized():
            comm.barrier(tag="save_16bit_model: written")
        return True

    def save_sharded(
        self,
        save_dir: str | os.PathLike[str],
        dtype: torch.dtype | None = None,
        exclude_frozen: bool = False,
        max_shard_size: int | str | None = None,
        filename: str = "model.safetensors",
    ) -> ShardReport:
        """Hugging Face's sharded safetensors (``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``),
        each rank writing the files of its share from what it holds: no gather on any rank (parallel_save.py, [Note:
        writing in parallel]). ``dtype``: the training dtype unless given (``torch.float32`` for the masters);
        ``max_shard_size`` (bytes or ``"5GB"``) cuts a rank's share into more files. Returns this rank's report. Collective.
        """
        from slipstream.engine.checkpoint.capture import persistent_buffers

        named = list(self.module.named_parameters())
        frozen = {name for name, p in named if not p.requires_grad}
        return write_sharded(
            Path(save_dir),
            filename,
            self.strategy.sharded_state(),
            [name for name, _ in named],
            frozen,
            persistent_buffers(self.module),
            dtype or self.dtype,
            exclude_frozen,
            max_shard_size,
        )


class SavesWeights:
    """The engine's DeepSpeed-named calls that write or gather the whole model (see [Note: DeepSpeed's names]
    in engine.py), each delegating to the engine's :class:`ModelWeights`."""

    weights: ModelWeights

    def consolidated_state_dict(
        self, dtype: torch.dtype | None = None, exclude_frozen_parameters: bool = False
    ) -> dict[str, torch.Tensor] | None:
        """Full weights by parameter name on rank 0, ``None`` on other ranks. Call on every rank.

        ``dtype=None`` gives the fp32 master values; pass the training dtype (``engine.training_dtype``)
        for what ``save_16bit_model`` writes.
        """
        return self.weights.consolidated(dtype, exclude_frozen_parameters)

    @property
    def training_dtype(self) -> torch.dtype:
        """The dtype the model computes in: fp16, bf16 or fp32."""
        return self.weights.dtype

    def gathered_model_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor] | None:
        """What ``save_16bit_model`` writes, as a dict on rank 0 (``None`` elsewhere): parameters in the
        training dtype and persistent buffers, for a host's own ``save_pretrained(state_dict=...)``. Collective."""
        return self.weights.full_state(exclude_frozen_parameters)

    def save_16bit_model(
        self,
        save_dir: str | os.PathLike[str],
        save_filename: str = "pytorch_model.bin",
        exclude_frozen_parameters: bool = False,
        sharded: bool | None = None,
    ) -> bool:
        """Write the full weights in the training dtype to ``save_dir/save_filename`` (rank 0). Call on every rank.

        A ``.safetensors`` name writes safetensors; any other a ``torch.save`` of a plain tensor dict
        (readable with ``weights_only=True``), as Hugging Face's ``from_pretrained`` expects. ``sharded``
        (default: a ``.safetensors`` name at world size > 1): every rank writes its own Hugging Face shard
        files, ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``, and none gathers.
        """
        return self.weights.save(save_dir, save_filename, exclude_frozen_parameters, sharded)
