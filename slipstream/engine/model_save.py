"""Full model weights out of a sharded engine: a gathered state dict, and the file Hugging Face loads.

[Note: what a saved model holds] ``save_16bit_model`` writes what ``model.state_dict()`` of the
plain model would hold, in the training dtype: every parameter under its ``named_parameters()``
name (gathered from the shards at any stage) and every persistent buffer. Tied weights appear once,
as ``save_pretrained`` writes them; ``from_pretrained`` re-ties them. The file is safetensors or a
``torch.save`` of a plain tensor dict, so loading it never needs to unpickle objects.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

Engine = Any  # the Engine calls in here; typing it by name would make an import cycle


def consolidated(engine: Engine, dtype: torch.dtype | None, exclude_frozen: bool) -> dict[str, torch.Tensor] | None:
    """The strategy's fp32 gathered parameters, cast to ``dtype``, without frozen ones on request. Collective."""
    if _has_pieces(engine):
        state = assembled_state_dict(engine)
    else:
        state = engine.strategy.consolidated_state_dict()
    if state is None:
        return None
    if exclude_frozen:
        frozen = {name for name, p in engine.module.named_parameters() if not p.requires_grad}
        state = {name: value for name, value in state.items() if name not in frozen}
    if dtype is not None:
        state = {name: value.to(dtype) for name, value in state.items()}
    return state


def _has_pieces(engine: Engine) -> bool:
    """True when some rank holds only a piece of a parameter beyond ZeRO (tensor parallel cuts)."""
    mesh = getattr(engine, "mesh", None)
    return mesh is not None and mesh.size("tp") > 1


def assembled_state_dict(engine: Engine) -> dict[str, torch.Tensor] | None:
    """Full fp32 weights on rank 0 from every rank's checkpoint slices, each piece put where its placement says. Collective.

    [Note: two phases] ZeRO cuts a rank's tensor-parallel piece into flat ranges over dp, so the
    ranges are first joined into their piece (keyed by the piece's position), then the piece is
    written into the global tensor: one box (``utils.placement``) or, for a packed projection, one
    box per packed part (``parallel.tensor.packed_piece``). Duplicates (``duplicate=True``) and
    ZeRO-replicated copies on dense ranks other than 0 are not sent.
    """
    from slipstream.engine.parallel.tensor import packed_piece
    from slipstream.utils.placement import global_shape_and_box, is_duplicate

    params = dict(engine.module.named_parameters())
    dense_rank = dist.get_rank(engine.mesh.dense_group)
    pieces = []
    for owned in engine.strategy.sharded_state():
        param = params[owned.slice.name]
        if is_duplicate(param) or (owned.replicated and dense_rank != 0):
            continue
        packed = packed_piece(param)
        shape, box = (packed.global_shape, None) if packed is not None else global_shape_and_box(param)
        key = (owned.slice.name, box[0] if box is not None else None, packed.offset if packed is not None else None)
        value = owned.value.detach().float().cpu().clone()
        pieces.append((key, shape, tuple(param.shape), box, packed, owned.slice.start, value))
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(pieces, gathered, dst=0)
    if gathered is None:
        return None
    locals_: dict[Any, tuple[tuple[int, ...], tuple[int, ...], Any, Any, torch.Tensor]] = {}
    for key, shape, local_shape, box, packed, start, value in (p for rank_pieces in gathered for p in rank_pieces):
        entry = locals_.setdefault(key, (shape, local_shape, box, packed, torch.zeros(math.prod(local_shape))))
        entry[4][start : start + value.numel()] = value
    state: dict[str, torch.Tensor] = {}
    for (name, _, _), (shape, local_shape, box, packed, flat) in locals_.items():
        full = state.setdefault(name, torch.zeros(shape))
        local = flat.view(local_shape)
        if packed is not None:
            for global_index, local_index in packed.boxes(local_shape):
                full[global_index] = local[local_index]
        elif box is None:
            full.copy_(local)
        else:
            full[tuple(slice(o, o + n) for o, n in zip(box[0], box[1]))] = local
    return {name: state[name] for name in params if name in state}


def full_model_state(engine: Engine, exclude_frozen: bool = False) -> dict[str, torch.Tensor] | None:
    """Parameters in the training dtype plus persistent buffers, on rank 0 (``None`` elsewhere). Collective."""
    from slipstream.engine.checkpoint.capture import persistent_buffers  # shared: what state_dict() holds

    state = consolidated(engine, engine.training_dtype, exclude_frozen)
    if state is None:
        return None
    for name, buffer in persistent_buffers(engine.module).items():
        state[name] = buffer.detach().cpu().clone()
    return {name: value.detach().cpu().contiguous() for name, value in state.items()}


def write_weights(path: Path, state: dict[str, torch.Tensor]) -> None:
    """Write ``state`` atomically: safetensors for a ``.safetensors`` name, else a plain-dict ``torch.save``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(state, str(part), metadata={"format": "pt"})
    else:
        torch.save(state, part)
    os.replace(part, path)


def save_model_weights(engine: Engine, save_dir: str | os.PathLike[str], filename: str, exclude_frozen: bool) -> bool:
    """``engine.save_16bit_model``: rank 0 writes; every rank returns True once the file exists. Collective."""
    state = full_model_state(engine, exclude_frozen)
    if state is not None:
        write_weights(Path(save_dir) / filename, state)
    if dist.is_initialized():
        dist.barrier()
    return True
