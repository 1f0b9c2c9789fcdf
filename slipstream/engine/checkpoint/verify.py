"""``inspect --verify``: read a checkpoint the way a load would, every byte, without an engine."""

from __future__ import annotations

import math

from slipstream.engine.checkpoint.reader import CheckpointReader, check_files
from slipstream.utils.pieces import ParamSlice


def verify(reader: CheckpointReader) -> int:
    """Check every file's CRC-32, assemble every parameter and optimizer state, decode every tree; returns tensors read.

    Raises the same :class:`CheckpointError` a load would (the reader's constructor has already
    checked the slice coverage).
    """
    check_files(reader.path, reader.manifest, checksums=True)
    count = 0
    for name, info in reader.manifest["parameters"].items():
        whole = ParamSlice(name, tuple(info["shape"]), 0, math.prod(info["shape"]))
        reader.read_param(whole)
        reader.read_optimizer_state(whole)
        count += 1
    common = reader.common()
    for key in ("optimizer_groups", "lr_scheduler", "loss_scaler", "client_state"):
        if common.get(key) is not None:
            reader.decode(0, common[key])
    for key in common["buffers"].values():
        reader.tensor(0, key)
        count += 1
    for rank in range(reader.world_size):
        meta = reader.rank_meta(rank)
        reader.decode(rank, meta["rng"])
        for tree in meta["stateful"].values():
            reader.decode(rank, tree)
    return count
