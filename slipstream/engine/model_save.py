"""Full model weights out of a sharded engine: a gathered state dict, and the file Hugging Face loads.

[Note: what a saved model holds] ``save_16bit_model`` writes what ``model.state_dict()`` of the
plain model would hold, in the training dtype: every parameter under its ``named_parameters()``
name (gathered from the shards at any stage) and every persistent buffer. Tied weights appear once,
as ``save_pretrained`` writes them; ``from_pretrained`` re-ties them. The file is safetensors or a
``torch.save`` of a plain tensor dict, so loading it never needs to unpickle objects.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

Engine = Any  # the Engine calls in here; typing it by name would make an import cycle


def consolidated(engine: Engine, dtype: torch.dtype | None, exclude_frozen: bool) -> dict[str, torch.Tensor] | None:
    """The strategy's fp32 gathered parameters, cast to ``dtype``, without frozen ones on request. Collective."""
    state = engine.strategy.consolidated_state_dict()
    if state is None:
        return None
    if exclude_frozen:
        frozen = {name for name, p in engine.module.named_parameters() if not p.requires_grad}
        state = {name: value for name, value in state.items() if name not in frozen}
    if dtype is not None:
        state = {name: value.to(dtype) for name, value in state.items()}
    return state


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
