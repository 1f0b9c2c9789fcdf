"""One consolidated fp32 safetensors file from a checkpoint's files alone (no processes, any world size).

Every key of the model's ``state_dict()`` is written, tied weights under each of their names, so
``model.load_state_dict(safetensors.torch.load_file(out), strict=True)`` works on the plain model.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from slipstream.engine.checkpoint.format import LATEST, TMP_PREFIX, TRASH_PREFIX, write_safetensors
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
    out = _check_output(Path(out), path)
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(out.name + ".part")
    metadata = {
        "format": "pt",
        "slipstream_checkpoint": str(path),
        "global_steps": str(reader.manifest["global_steps"]),
    }
    try:
        write_safetensors(part, tensors, metadata)
        os.replace(part, out)
    finally:
        if part.is_file():
            part.unlink()
    return path, len(tensors)


def _check_output(out: Path, checkpoint: Path) -> Path:
    """Refuse an output that is a directory or lies inside the checkpoint (or its save directory's ``latest``)."""
    if out.is_dir():
        raise CheckpointError(f"export: {out} is a directory; pass a file path such as {out / 'model.safetensors'}")
    resolved, source = out.resolve(), checkpoint.resolve()
    if (
        resolved.is_relative_to(source)
        or resolved == source.parent / LATEST
        or resolved.parent.name.startswith((TMP_PREFIX, TRASH_PREFIX))
    ):
        raise CheckpointError(
            f"export: {out} lies inside the checkpoint {checkpoint} it exports and could overwrite one of its files; "
            "write the export elsewhere"
        )
    return out
