"""Loading a DeepSpeed checkpoint into a running job: convert once per node, load, delete. Collective.

[Note: one conversion per node] The first rank of each node (``LOCAL_RANK`` 0) converts the
DeepSpeed checkpoint into a private temporary directory (``$TMPDIR``), the ranks learn their node's
directory through one small all-gather keyed by host name, every rank loads from it with the
ordinary reader (any world size, stage and mesh), and the converting rank deletes it once all
ranks are done. A conversion that fails on any node fails the load on every rank, before anything
is applied.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

from slipstream import comm
from slipstream.comm import all_gather_objects
from slipstream.engine.checkpoint.agree import agree
from slipstream.engine.checkpoint.formats.deepspeed.convert import convert
from slipstream.engine.checkpoint.validate import CheckpointError

TAG = "converted"


@contextlib.contextmanager
def staged(source: Path) -> Iterator[Path]:
    """The slipstream checkpoint converted from the DeepSpeed one at ``source``, for as long as the block runs."""
    converts = int(os.environ.get("LOCAL_RANK", "0")) == 0 or not dist.is_initialized()
    made: Path | None = None

    def run() -> str | None:
        nonlocal made
        if not converts:
            return None
        made = Path(tempfile.mkdtemp(prefix="slipstream-deepspeed-"))
        return str(convert(source, made, TAG, save_latest=False))

    mine = agree(run, f"converting the DeepSpeed checkpoint {source}")
    try:
        path = _node_path(mine)
        yield Path(path)
    finally:
        if dist.is_initialized() and dist.get_world_size() > 1:
            comm.barrier(tag="DeepSpeed checkpoint conversion: done")
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)


def _node_path(mine: str | None) -> str:
    """This node's converted checkpoint: the path its converting rank made."""
    host = socket.gethostname()
    every = all_gather_objects((host, mine))
    found = next((path for name, path in every if name == host and path is not None), None)
    if found is None:
        raise CheckpointError(
            f"load_checkpoint: no rank with LOCAL_RANK 0 on host {host} converted the DeepSpeed checkpoint"
        )
    return found
