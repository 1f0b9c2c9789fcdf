"""Slipstream's own format, the one ``save_checkpoint`` writes: found and loaded here for the format table.

Its machinery is the rest of ``engine/checkpoint/``: ``capture.py`` and ``writer.py`` save it
(atomically, through ``manager.py``), ``reader.py`` reads and validates it, ``tiling.py`` checks that
its slices cover each parameter, ``restore.py`` applies it. Format notes: docs/checkpoints.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from slipstream.engine.checkpoint.agree import agree
from slipstream.engine.checkpoint.reader import CheckpointReader, resolve
from slipstream.engine.checkpoint.restore import restore
from slipstream.engine.checkpoint.target import CheckpointTarget
from slipstream.utils.logging import get_logger

logger = get_logger(__name__)


def detect(load_dir: str | Path, tag: str | None, verify_checksums: bool) -> Path | None:
    """The checkpoint directory ``load_dir`` (``latest``, or ``tag``) names, or None when there is none."""
    return resolve(load_dir, tag, verify_checksums)


def load(
    target: CheckpointTarget, path: Path, options: dict[str, Any], verify_checksums: bool
) -> tuple[str, dict[str, Any]]:
    """Validate everything, then apply it to ``target`` (see restore.py); the path and the client state. Collective."""
    reader = agree(lambda: CheckpointReader(path, verify_checksums=verify_checksums), "opening the checkpoint")
    client_state = restore(target, reader, dist.get_rank(), agree=agree, **options)
    logger.info(
        "loaded checkpoint %s (saved at step %d by %d ranks, ZeRO stage %d)",
        path,
        reader.manifest["global_steps"],
        reader.world_size,
        reader.manifest["zero_stage"],
    )
    return str(path), client_state
