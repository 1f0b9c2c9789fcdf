"""Hugging Face weights from a checkpoint's files alone (no processes, any world size), one parameter in memory at a time.

* ``export_fp32``: one consolidated fp32 safetensors file with every key of the model's
  ``state_dict()``, tied weights under each of their names, so
  ``model.load_state_dict(safetensors.torch.load_file(out), strict=True)`` works on the plain model;
* ``export_hf``: the sharded layout ``from_pretrained`` loads (files.py, [Note: the sharded layout]).

Neither may write into the checkpoint it reads (``_check_output``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from slipstream.engine.checkpoint.format import LATEST, TMP_PREFIX, TRASH_PREFIX
from slipstream.engine.checkpoint.formats.hf.files import (
    DEFAULT_MAX_SHARD_SIZE,
    FilePlan,
    Spec,
    finish_directory,
    parse_size,
    plan_files,
    write_file,
    write_safetensors_file,
)
from slipstream.engine.checkpoint.reader import CheckpointError, CheckpointReader, resolve


def export_fp32(checkpoint: str | Path, out: str | Path, tag: str | None = None) -> tuple[Path, int]:
    """Write the checkpoint (``latest``, or ``tag``) to ``out``; returns the checkpoint used and the key count."""
    path, reader = _open(checkpoint, tag)
    out = _check_output(Path(out), path, directory=False)
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
    out.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"slipstream_checkpoint": str(path), "global_steps": str(reader.manifest["global_steps"])}
    write_safetensors_file(out, tensors, metadata)  # a safetensors file whatever the name
    return path, len(tensors)


def export_hf(
    checkpoint: str | Path,
    out_dir: str | Path,
    tag: str | None = None,
    dtype: torch.dtype = torch.float32,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> tuple[Path, FilePlan]:
    """Write a checkpoint (``latest``, or ``tag``) as Hugging Face safetensors shards into ``out_dir``, one parameter in
    memory at a time; returns the checkpoint used and the plan written. Parameters in ``dtype``, buffers as saved."""
    max_bytes = parse_size(max_shard_size)
    path, reader = _open(checkpoint, tag)
    out = _check_output(Path(out_dir), path, directory=True)
    manifest, saved_buffers = reader.manifest, reader.common()["buffers"]
    specs: list[Spec] = []
    for key, held in manifest["state_dict_keys"].items():  # tied aliases point at another name: written once
        if held.get("param") == key:
            specs.append(Spec(key, tuple(manifest["parameters"][key]["shape"]), dtype))
        elif held.get("buffer") == key:
            specs.append(
                Spec(key, tuple(manifest["buffers"][key]["shape"]), getattr(torch, manifest["buffers"][key]["dtype"]))
            )

    def fetch(key: str) -> torch.Tensor:
        if key in manifest["parameters"]:
            return reader.full_param(key).to(dtype)
        return reader.tensor(0, saved_buffers[key])

    plan = plan_files([specs], "model.safetensors", max_bytes)
    out.mkdir(parents=True, exist_ok=True)
    for _, name, file_specs in plan.files:
        write_file(out / name, file_specs, fetch)
    finish_directory(out, plan, sum(s.numel for s in specs if s.key in manifest["parameters"]))
    return path, plan


def _open(checkpoint: str | Path, tag: str | None) -> tuple[Path, CheckpointReader]:
    """The checkpoint ``checkpoint`` (``latest``, or ``tag``) names, and its reader (every file checked)."""
    path = resolve(checkpoint, tag)
    if path is None:
        raise CheckpointError(f"no checkpoint in {checkpoint}")
    return path, CheckpointReader(path)


def _check_output(out: Path, checkpoint: Path, directory: bool) -> Path:
    """Refuse an output of the wrong kind (a directory for a file, a file for a directory) or one that lies inside
    the checkpoint (or is its save directory's ``latest``, or a save in progress there)."""
    if directory and out.exists() and not out.is_dir():
        raise CheckpointError(f"export --format hf: {out} is a file; pass the directory to write the shards into")
    if not directory and out.is_dir():
        raise CheckpointError(f"export: {out} is a directory; pass a file path such as {out / 'model.safetensors'}")
    resolved, source = out.resolve(), checkpoint.resolve()
    staging = (resolved if directory else resolved.parent).name.startswith((TMP_PREFIX, TRASH_PREFIX))
    if resolved.is_relative_to(source) or resolved == source.parent / LATEST or staging:
        raise CheckpointError(
            f"export: {out} lies inside the checkpoint {checkpoint} it exports and could overwrite one of its files; "
            "write the export elsewhere"
        )
    return out
