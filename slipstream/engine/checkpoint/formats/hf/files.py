"""Hugging Face's safetensors files: the sharded layout's plan, one file's writing, the index last.

[Note: the sharded layout] ``model-00001-of-00003.safetensors`` ... ``model-00003-of-00003.safetensors``
and ``model.safetensors.index.json`` = ``{"metadata": {"total_size": bytes, "total_parameters": n},
"weight_map": {key: file}}``: what ``save_pretrained`` writes for a model bigger than one shard, and what
``from_pretrained`` loads. Each file is safetensors with metadata ``{"format": "pt"}``, written to
``<name>.part`` and renamed; the index is written last, once every file is in place. When everything
fits in one file it is ``model.safetensors`` with no index, as ``save_pretrained`` does. The keys are
what a saved model holds (model_save.py, [Note: what a saved model holds]): every parameter once under
its ``named_parameters()`` name (tied weights once; ``from_pretrained`` re-ties them) and every
persistent buffer.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch

from slipstream.engine.checkpoint.format import safetensors_header, write_safetensors

DEFAULT_MAX_SHARD_SIZE = "5GB"  # save_pretrained's default

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a size such as ``"5GB"`` (10^9, as Hugging Face) or ``"500MiB"`` (2^20)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]I?B|B)?\s*", str(size).upper())
        if found is None:
            raise ValueError(f"max_shard_size: expected bytes or a size such as '5GB' or '500MiB', got {size!r}")
        value = int(float(found[1]) * _UNITS[found[2] or ""])
    if value <= 0:
        raise ValueError(f"max_shard_size: must be positive, got {size!r}")
    return value


def shard_name(filename: str, index: int, count: int) -> str:
    """``model.safetensors`` -> ``model-00002-of-00005.safetensors`` (``index`` counts from 1)."""
    stem, suffix = filename.removesuffix(".safetensors"), ".safetensors"
    return f"{stem}-{index:05d}-of-{count:05d}{suffix}"


def index_name(filename: str) -> str:
    return f"{filename}.index.json"


@dataclasses.dataclass(frozen=True)
class Spec:
    """One tensor of the output: its key, shape and dtype (what the file header says before the bytes exist)."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class FilePlan:
    """Every output file in order: (writing rank, file name, its tensors in file order)."""

    files: list[tuple[int, str, list[Spec]]]
    filename: str

    @property
    def weight_map(self) -> dict[str, str]:
        return {spec.key: name for _, name, specs in self.files for spec in specs}

    @property
    def total_size(self) -> int:
        return sum(spec.nbytes for _, _, specs in self.files for spec in specs)

    def of_rank(self, rank: int) -> list[tuple[str, list[Spec]]]:
        return [(name, specs) for r, name, specs in self.files if r == rank]


def cut(specs: list[Spec], max_bytes: int | None) -> list[list[Spec]]:
    """``specs`` in order, cut as ``save_pretrained`` cuts: a new file when the next tensor would pass ``max_bytes``
    (a tensor bigger than that gets a file of its own)."""
    files: list[list[Spec]] = []
    size = 0
    for spec in specs:
        if not files or (max_bytes is not None and size + spec.nbytes > max_bytes and size > 0):
            files.append([])
            size = 0
        files[-1].append(spec)
        size += spec.nbytes
    return files


def plan_files(shares: list[list[Spec]], filename: str, max_bytes: int | None) -> FilePlan:
    """Each rank's share (in order) cut at ``max_bytes`` and named; an empty share writes no file."""
    cuts = [(rank, specs) for rank, share in enumerate(shares) for specs in cut(share, max_bytes)]
    if len(cuts) == 1:
        return FilePlan([(cuts[0][0], filename, cuts[0][1])], filename)
    return FilePlan(
        [(rank, shard_name(filename, i + 1, len(cuts)), specs) for i, (rank, specs) in enumerate(cuts)], filename
    )


def split_shares(sizes: list[int], parts: int) -> list[int]:
    """The share of each item (in order) for ``parts`` contiguous shares balanced by size: an item goes to the
    share its middle byte falls in."""
    total = max(sum(sizes), 1)
    shares, at = [], 0
    for n in sizes:
        shares.append(min(parts - 1, (2 * at + n) * parts // (2 * total)))
        at += n
    return shares


def write_file(path: Path, specs: list[Spec], fetch: Callable[[str], torch.Tensor]) -> None:
    """Stream ``fetch(key)`` for each spec into a safetensors file, atomically (``.part``, fsync, rename).

    The header is written first from the specs, so a tensor is asked for only when its bytes are
    written and dropped right after: memory holds one tensor of the file at a time.
    """
    header = safetensors_header([(spec.key, spec.dtype, spec.shape) for spec in specs], {"format": "pt"})
    part = path.with_name(path.name + ".part")
    try:
        with open(part, "wb") as f:
            f.write(header)
            for spec in specs:
                t = fetch(spec.key)
                if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
                    raise RuntimeError(
                        f"{spec.key}: got a {t.dtype} tensor of shape {tuple(t.shape)}, planned {spec.dtype} {spec.shape}"
                    )
                if t.numel():
                    f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
                del t
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, path)
    finally:
        if part.exists():
            part.unlink()


def finish_directory(save_dir: Path, plan: FilePlan, total_parameters: int) -> None:
    """Write the index (several files) and remove what a previous save left that would confuse a load:
    other ``<stem>-NNNNN-of-NNNNN`` shards, the single file beside an index (it would win), an index beside one file."""
    filename = plan.filename
    sharded = len(plan.files) > 1
    if sharded:
        index = {
            "metadata": {"total_size": plan.total_size, "total_parameters": total_parameters},
            "weight_map": plan.weight_map,
        }
        path = save_dir / index_name(filename)
        part = path.with_name(path.name + ".part")
        part.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        os.replace(part, path)
    keep = {name for _, name, _ in plan.files}
    pattern = re.compile(re.escape(filename.removesuffix(".safetensors")) + r"-\d{5}-of-\d{5}\.safetensors")
    stale = [p for p in save_dir.iterdir() if pattern.fullmatch(p.name) and p.name not in keep]
    stale += [save_dir / filename] if sharded else [save_dir / index_name(filename)]
    for path in stale:
        if path.is_file():
            path.unlink()


def write_whole(path: Path, state: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """The whole model in one file, atomically: safetensors for a ``.safetensors`` name, else a plain-dict
    ``torch.save`` (``pytorch_model.bin``), as ``save_pretrained`` writes when everything fits in one shard."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".safetensors":
        write_safetensors_file(path, state, metadata)
        return
    part = path.with_name(path.name + ".part")
    torch.save(state, part)
    os.replace(part, path)


def write_safetensors_file(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    """``tensors`` as one safetensors file with ``{"format": "pt"}`` and ``metadata``, atomically: written to
    ``<name>.part``, fsynced and renamed; a failed write leaves no ``.part`` behind. A tensor under two keys
    (tied weights in ``state_dict()``) is written under each."""
    part = path.with_name(path.name + ".part")
    try:
        write_safetensors(part, tensors, {"format": "pt", **(metadata or {})}, checksum=False)
        os.replace(part, path)
    finally:
        if part.is_file():
            part.unlink()
