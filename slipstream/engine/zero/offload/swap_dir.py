"""Where swap files live: ``nvme_path/<job-id>/rank<r>/``, checked up front and removed on exit.

[Note: stale swap files] A killed run cannot clean up after itself. Each rank directory holds an
``owner`` file (host and pid); a new run removes the rank directories whose owner is a dead
process on this host, and never reads another job's files (its own job id is fresh), so
leftovers can cost disk space until the next start but never break a run.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import time
import uuid
from pathlib import Path

from slipstream.engine.config.base import ConfigError
from slipstream.utils.logging import get_logger

logger = get_logger(__name__)

_OWNER = "owner"


def new_job_id() -> str:
    """A fresh job id (rank 0 makes it; ranks agree on it through a broadcast)."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


_open: dict[Path, SwapDir] = {}


class SwapDir:
    """One rank's swap directory. ``key`` names the config key in error messages.

    Optimizer and parameter swap files may share a directory: :meth:`open` hands out one object
    per directory and the files go when the last user calls :meth:`remove` (or at exit).
    """

    @classmethod
    def open(cls, nvme_path: str, job_id: str, rank: int, key: str) -> SwapDir:
        path = Path(nvme_path).expanduser() / job_id / f"rank{rank}"
        existing = _open.get(path)
        if existing is not None and not existing.closed:
            existing.users += 1
            return existing
        made = cls(nvme_path, job_id, rank, key)
        _open[path] = made
        return made

    def __init__(self, nvme_path: str, job_id: str, rank: int, key: str) -> None:
        self.root, self.key = Path(nvme_path).expanduser(), key
        self.path = self.root / job_id / f"rank{rank}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            remove_stale(self.root)
            self.path.mkdir(parents=True, exist_ok=True)
            (self.path / _OWNER).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
        except OSError as err:
            raise ConfigError(
                f"{key}: cannot create swap files under {str(self.root)!r} ({err.strerror or err}); point it at a writable local disk"
            ) from None
        self.closed, self.users = False, 1
        atexit.register(self.remove, force=True)

    def check_space(self, nbytes: int) -> None:
        """ValueError naming the path when the filesystem has less than ``nbytes`` (+1%) free."""
        free = shutil.disk_usage(self.path).free
        if free < nbytes * 1.01:
            self.remove(force=True)
            raise ConfigError(
                f"{self.key}: {str(self.root)!r} has {free / 2**30:.2f} GiB free, this rank's swap files need "
                f"{nbytes / 2**30:.2f} GiB; free space or choose another path"
            )

    def file(self, name: str) -> str:
        return str(self.path / name)

    def remove(self, force: bool = False) -> None:
        """Delete this rank's files (and the job directory once empty) when its last user is done."""
        self.users -= 1
        if self.closed or (self.users > 0 and not force):
            return
        self.closed = True
        shutil.rmtree(self.path, ignore_errors=True)
        try:
            self.path.parent.rmdir()
        except OSError:
            pass  # other ranks' directories still there


def remove_stale(root: Path) -> None:
    """Remove rank directories under ``root`` left by dead processes on this host."""
    host = socket.gethostname()
    for owner in root.glob(f"*/rank*/{_OWNER}"):
        try:
            info = json.loads(owner.read_text())
        except (OSError, ValueError):
            continue
        if info.get("host") != host or _alive(int(info.get("pid", -1))):
            continue
        logger.warning("removing stale swap files of a dead run (pid %s): %s", info.get("pid"), owner.parent)
        shutil.rmtree(owner.parent, ignore_errors=True)
        try:
            owner.parent.parent.rmdir()
        except OSError:
            pass


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def shared_job_id(group: object) -> str:
    """One job id for every rank of ``group`` (a process group; rank 0's), so swap directories sit side by side."""
    import torch.distributed as dist

    from slipstream import comm

    job = new_job_id()
    if dist.get_world_size(group) > 1:  # type: ignore[arg-type]
        src = dist.get_global_rank(group, 0) if group is not None else 0  # type: ignore[arg-type]
        job = comm.broadcast_object(job, src=src, group=group, tag="swap directory job id")  # type: ignore[arg-type]
    return job
