"""Writing a checkpoint so that a crash at any instant leaves every earlier checkpoint loadable.

[Note: the commit protocol] Ranks write into ``<save_dir>/.tmp-<tag>/``, which no reader ever
takes for a checkpoint. Each rank writes and fsyncs its safetensors file, then its JSON (renamed
into place last, so its presence means the rank is done; it records the tensor file's size and
CRC-32). Rank 0 then writes ``manifest.json`` with every file's size and CRC-32, fsyncs, renames
the directory to ``<tag>`` (atomic), fsyncs ``save_dir``, and only then replaces ``latest`` (a
temporary file renamed over it). Killed before the rename: only a ``.tmp-`` directory is left.
Killed after it: the new checkpoint is complete and ``latest`` points to it or to the previous
one. Retention deletes old checkpoints only after that, and never the one ``latest`` names.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from slipstream.engine.checkpoint.engine_state import Payload
from slipstream.engine.checkpoint.format import (
    CONFIG,
    LATEST,
    MANIFEST,
    TMP_PREFIX,
    TRASH_PREFIX,
    fsync_dir,
    rank_stem,
    write_bytes_durably,
    write_json_durably,
    write_safetensors,
)
from slipstream.engine.checkpoint.reader import complete_checkpoints, latest_tag
from slipstream.utils.logging import get_logger

logger = get_logger(__name__)


def check_tag(tag: str) -> str:
    if not tag or "/" in tag or "\\" in tag or tag.startswith(".") or tag == LATEST:
        raise ValueError(f"save_checkpoint: tag {tag!r} must be a plain directory name (no '/', not starting with '.', not {LATEST!r})")
    return tag


def temp_dir(save_dir: Path, tag: str) -> Path:
    return save_dir / f"{TMP_PREFIX}{tag}"


def prepare(save_dir: Path, tag: str) -> Path:
    """Rank 0, before any rank writes: an empty temporary directory (leftovers of a crashed save removed)."""
    tmp = temp_dir(save_dir, tag)
    save_dir.mkdir(parents=True, exist_ok=True)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def write_rank(tmp: Path, payload: Payload) -> None:
    """One rank's files; its JSON appears last (renamed into place), marking the rank done."""
    stem = rank_stem(payload.rank)
    record = write_safetensors(tmp / f"{stem}.safetensors", payload.tensors)
    if payload.config is not None:
        write_json_durably(tmp / CONFIG, payload.config)
    meta = {**payload.meta, "tensor_file": record}
    part = tmp / f"{stem}.json.part"
    write_json_durably(part, meta)
    os.replace(part, tmp / f"{stem}.json")


def commit(
    save_dir: Path, tag: str, tmp: Path, world: int, manifest: dict[str, Any], save_latest: bool, timeout: float,
    keep_last_n: int = 0,
) -> Path:  # fmt: skip
    """Rank 0: wait for every rank's files, write the manifest, move the checkpoint into place, point ``latest`` at it."""
    files: dict[str, dict[str, int]] = {}
    deadline = time.monotonic() + timeout
    for rank in range(world):
        meta_path = tmp / f"{rank_stem(rank)}.json"
        while not meta_path.is_file():
            if time.monotonic() > deadline:
                raise TimeoutError(f"checkpoint {tag}: rank {rank} did not finish writing within {timeout:.0f}s; not committed")
            time.sleep(0.01)
        data = meta_path.read_bytes()
        files[meta_path.name] = _record(data)
        files[f"{rank_stem(rank)}.safetensors"] = json.loads(data)["tensor_file"]
    config = tmp / CONFIG
    files[CONFIG] = _record(config.read_bytes())
    write_json_durably(tmp / MANIFEST, {**manifest, "files": files, "checksum": "crc32"})
    fsync_dir(tmp)
    final = save_dir / tag
    trash = None
    if final.exists():  # saving a tag again: the old one leaves only once the new one is in place
        trash = save_dir / f"{TRASH_PREFIX}{tag}-{time.time_ns()}"
        os.replace(final, trash)
    os.replace(tmp, final)
    fsync_dir(save_dir)
    if save_latest:
        write_latest(save_dir, tag)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    if keep_last_n > 0:
        retain(save_dir, keep_last_n)
    return final


def _record(data: bytes) -> dict[str, int]:
    import zlib

    return {"bytes": len(data), "crc32": zlib.crc32(data)}


def write_latest(save_dir: Path, tag: str) -> None:
    part = save_dir / f"{TMP_PREFIX}{LATEST}"
    write_bytes_durably(part, tag.encode())
    os.replace(part, save_dir / LATEST)
    fsync_dir(save_dir)


def retain(save_dir: Path, keep_last_n: int) -> list[Path]:
    """Delete complete checkpoints beyond the newest ``keep_last_n``, never the one ``latest`` names."""
    keep = latest_tag(save_dir)
    old = complete_checkpoints(save_dir)[:-keep_last_n]
    removed = []
    for path, _ in old:
        if path.name == keep:
            continue
        trash = save_dir / f"{TRASH_PREFIX}{path.name}-{time.time_ns()}"
        os.replace(path, trash)  # out of sight at once; the slow delete follows
        shutil.rmtree(trash, ignore_errors=True)
        removed.append(path)
    if removed:
        logger.info("checkpoint retention (keep_last_n=%d): removed %s", keep_last_n, ", ".join(p.name for p in removed))
    return removed
