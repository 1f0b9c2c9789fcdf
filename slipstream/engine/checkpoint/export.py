"""One consolidated fp32 safetensors file from a checkpoint's files alone (no processes, any world size).

Every key of the model's ``state_dict()`` is written, tied weights under each of their names, so
``model.load_state_dict(safetensors.torch.load_file(out), strict=True)`` works on the plain model.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from slipstream.engine.checkpoint.format import write_safetensors
from slipstream.engine.checkpoint.reader import CheckpointError, CheckpointReader, resolve


def export_fp32(checkpoint: str | Path, out: str | Path, tag: str | None = None) -> tuple[Path, int]:
    """Write the checkpoint (``latest``, or ``tag``) to ``out``; returns the checkpoint used and the key count."""
    path = resolve(checkpoint, tag)
    if path is None:
        raise CheckpointError(f"no checkpoint in {checkpoint}")
    reader = CheckpointReader(path)
    buffers = reader.common()["buffers"]
    values: dict[str, torch.Tensor] = {}
    tensors: dict[str, torch.Tensor] = {}
    for key, source in reader.manifest["state_dict_keys"].items():
        if "param" in source:
            name = source["param"]
            if name not in values:
                values[name] = reader.full_param(name)
            tensors[key] = values[name]
        else:
            tensors[key] = reader.tensor(0, buffers[source["buffer"]])
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(out.name + ".part")
    metadata = {"format": "pt", "slipstream_checkpoint": str(path), "global_steps": str(reader.manifest["global_steps"])}
    write_safetensors(part, tensors, metadata)
    os.replace(part, out)
    return path, len(tensors)
