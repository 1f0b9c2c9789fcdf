"""Writing a checkpoint so that a crash at any instant leaves every earlier checkpoint loadable.

[Note: the commit protocol] Ranks write into ``<save_dir>/.tmp-<tag>/``, which no reader ever
takes for a checkpoint. Each rank writes and fsyncs its safetensors file, then its JSON (renamed
into place last, so its presence means the rank is done; it records the tensor file's size and
CRC-32). Rank 0 then writes ``manifest.json`` with every file's size and CRC-32, fsyncs, renames
the directory to ``<tag>`` (atomic), fsyncs ``save_dir``, and only then replaces ``latest`` (a
temporary file renamed over it). Killed before the rename: only a ``.tmp-`` directory is left.
Killed after it: the new checkpoint is complete and ``latest`` points to it or to the previous
one. Retention deletes old checkpoints only after that, and never the one ``latest`` names.

[Note: saving a tag again] ``<tag>`` already exists (``"last"``, ``"best"``): the new directory
and the old one are swapped in one ``renameat2(RENAME_EXCHANGE)``, so ``<tag>`` is a complete
checkpoint at every instant; the old copy, now in ``.tmp-<tag>``, is deleted afterwards. Where the
file system cannot exchange, the old one is first renamed to ``.trash-<tag>-<ns>``: a crash in the
gap leaves ``<tag>`` missing, and readers then take the complete ``.tmp-<tag>`` (or the trash copy)
in its place; the next save puts it back (``recover``). A lock file per tag, held by rank 0 from
``prepare`` to the end of the commit, makes a second job saving the same tag fail at once.

[Note: removing the lock file] The lock is the ``flock`` on the file's inode, not the file's
existence, so its holder unlinks ``.lock-<tag>`` while it still holds it and only then closes it.
A job that opened the file just before the unlink may get the flock on the unlinked inode once it
is released; so whoever takes the lock checks, after ``flock`` succeeds, that the path still names
the inode it locked, and otherwise drops it and starts over on the new file. While a holder holds,
the path names its inode (only a holder unlinks), so two jobs never both hold one tag. A process
killed while holding leaves the file behind, unlocked: the next save of that tag takes and removes
it, and ``recover`` removes such leftovers of other tags. Lock files are never checkpoints (a
checkpoint is a directory, and a tag cannot start with '.').
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from slipstream.engine.checkpoint.capture import Payload
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
from slipstream.engine.checkpoint.reader import (
    CheckpointError,
    check_coverage,
    complete_checkpoints,
    latest_tag,
    stand_in,
)
from slipstream.engine.checkpoint.validate import METADATA_CRC_ONLY
from slipstream.utils.logging import get_logger

logger = get_logger(__name__)


LOCK_PREFIX = ".lock-"


class TagLock:
    """An exclusive ``flock`` on ``<save_dir>/.lock-<tag>``; the kernel drops it if the process dies.

    :meth:`release` removes the file (see [Note: removing the lock file]).
    """

    ATTEMPTS = 100  # each retry means another process took and removed the file in between

    def __init__(self, save_dir: Path, tag: str) -> None:
        self.path = save_dir / f"{LOCK_PREFIX}{tag}"
        self._fd: int | None = None
        for _ in range(self.ATTEMPTS):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise CheckpointError(
                    f"save_checkpoint: another job is saving tag {tag!r} into {save_dir} right now ({self.path} is locked); "
                    "give each job its own save_dir or tag"
                ) from None
            except BaseException:
                os.close(fd)
                raise
            if _names(self.path, fd):
                self._fd = fd
                return
            os.close(fd)  # the previous holder removed the file after we opened it: lock the one there now
        raise CheckpointError(
            f"save_checkpoint: {self.path} was replaced {self.ATTEMPTS} times while being locked; not saving"
        )

    def release(self) -> None:
        """Remove the lock file while still holding it, then unlock (closing the descriptor)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if _names(self.path, fd):  # only a holder unlinks, so this is ours unless someone deleted it by hand
                os.unlink(self.path)
        except OSError as err:  # a leftover file is harmless: the next save of the tag removes it
            logger.debug("could not remove the checkpoint lock file %s: %s", self.path, err)
        finally:
            os.close(fd)


def _names(path: Path, fd: int) -> bool:
    """Whether ``path`` is the file open as ``fd`` (and not gone, or another file made since)."""
    try:
        on_disk = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (on_disk.st_dev, on_disk.st_ino) == (held.st_dev, held.st_ino)


def temp_dir(save_dir: Path, tag: str) -> Path:
    return save_dir / f"{TMP_PREFIX}{tag}"


def prepare(save_dir: Path, tag: str) -> TagLock:
    """Rank 0, before any rank writes: lock the tag, recover or clean what crashed saves left, make ``.tmp-<tag>``."""
    save_dir.mkdir(parents=True, exist_ok=True)
    lock = TagLock(save_dir, tag)
    try:
        recover(save_dir, tag)
        tmp = temp_dir(save_dir, tag)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    except BaseException:
        lock.release()
        raise
    return lock


def recover(save_dir: Path, own_tag: str) -> None:
    """Put back a checkpoint a crash left only in ``.tmp-``/``.trash-``; delete stale leftovers of unlocked tags.

    Another tag's leftovers are handled while holding that tag's lock, so a job saving it is never
    disturbed (a job starting to save it during that cleanup fails at once, as with any holder);
    lock files left by killed processes are removed the same way.
    """
    for child in sorted(save_dir.iterdir()):
        name = child.name
        if name.startswith(LOCK_PREFIX) and not child.is_dir():
            tag = name.removeprefix(LOCK_PREFIX)
            if tag != own_tag:
                _with_lock(save_dir, tag, lambda: None)  # a free one is taken, and removed on release
            continue
        if not child.is_dir() or not name.startswith((TMP_PREFIX, TRASH_PREFIX)):
            continue
        tag = (
            name.removeprefix(TMP_PREFIX)
            if name.startswith(TMP_PREFIX)
            else name.removeprefix(TRASH_PREFIX).rpartition("-")[0]
        )
        if tag == own_tag:
            _recover_tag(save_dir, tag, child)
        else:
            _with_lock(save_dir, tag, lambda tag=tag, child=child: _recover_tag(save_dir, tag, child))


def _with_lock(save_dir: Path, tag: str, action: Any) -> None:
    """Run ``action`` holding ``tag``'s lock; skip it when another job holds it (a save in progress) or it cannot be opened."""
    try:
        lock = TagLock(save_dir, tag)
    except (CheckpointError, OSError):  # OSError: e.g. another user's leftover lock file; not ours to clean
        return
    try:
        action()
    finally:
        lock.release()


def _recover_tag(save_dir: Path, tag: str, child: Path) -> None:
    """``child`` is a ``.tmp-``/``.trash-`` directory of ``tag``: put it back as ``tag`` if it is the only copy, else delete it."""
    if not child.exists():
        return  # handled with an earlier leftover of the same tag
    if not (save_dir / tag).exists():
        found = stand_in(save_dir, tag)
        if found is not None and found.exists():
            os.replace(found, save_dir / tag)
            fsync_dir(save_dir)
            return
    shutil.rmtree(child, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directory entries atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    libc = _libc()
    renameat2 = getattr(libc, "renameat2", None) if libc is not None else None
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"{os.strerror(err)} while exchanging {a} and {b}", str(a))


_LIBC: list[Any] = []


def _libc() -> Any:
    if not _LIBC:
        name = ctypes.util.find_library("c")
        _LIBC.append(ctypes.CDLL(name, use_errno=True) if name else None)
    return _LIBC[0]


def write_rank(tmp: Path, payload: Payload, checksum: bool = True) -> None:
    """One rank's files; its JSON appears last (renamed into place), marking the rank done. ``checksum``: see write_safetensors."""
    stem = rank_stem(payload.rank)
    record = write_safetensors(tmp / f"{stem}.safetensors", payload.tensors, checksum=checksum)
    if payload.config is not None:
        write_json_durably(tmp / CONFIG, payload.config)
    meta = {**payload.meta, "tensor_file": record}
    part = tmp / f"{stem}.json.part"
    write_json_durably(part, meta)
    os.replace(part, tmp / f"{stem}.json")


def commit(
    save_dir: Path,
    tag: str,
    tmp: Path,
    world: int,
    manifest: dict[str, Any],
    save_latest: bool,
    timeout: float,
    keep_last_n: int = 0,
) -> Path:
    """Rank 0: wait for every rank's files, write the manifest, move the checkpoint into place, point ``latest`` at it."""
    files: dict[str, dict[str, int]] = {}
    slices: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    for rank in range(world):
        meta_path = tmp / f"{rank_stem(rank)}.json"
        while not meta_path.is_file():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"checkpoint {tag}: rank {rank} did not finish writing within {timeout:.0f}s; not committed"
                )
            time.sleep(0.01)
        data = meta_path.read_bytes()
        meta = json.loads(data)
        files[meta_path.name] = _record(data)
        files[f"{rank_stem(rank)}.safetensors"] = meta["tensor_file"]
        slices.extend(meta["slices"])
    check_coverage(tag, manifest["parameters"], slices)  # never commit a checkpoint that misses weights
    config = tmp / CONFIG
    files[CONFIG] = _record(config.read_bytes())
    checksum = "crc32" if all("crc32" in record for record in files.values()) else METADATA_CRC_ONLY
    write_json_durably(tmp / MANIFEST, {**manifest, "files": files, "checksum": checksum})
    fsync_dir(tmp)
    final = save_dir / tag
    old = None
    if final.exists():  # saving a tag again: the old one leaves only once the new one is in place
        if _exchange(tmp, final):
            old = tmp
        else:
            old = save_dir / f"{TRASH_PREFIX}{tag}-{time.time_ns()}"
            os.replace(final, old)
            os.replace(tmp, final)
    else:
        os.replace(tmp, final)
    fsync_dir(save_dir)
    if save_latest:
        write_latest(save_dir, tag)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    if keep_last_n > 0:
        try:
            retain(save_dir, keep_last_n)
        except (
            OSError,
            CheckpointError,
        ) as err:  # the new checkpoint is committed: a failed cleanup must not undo that
            logger.warning("checkpoint retention (keep_last_n=%d) in %s failed: %s", keep_last_n, save_dir, err)
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
        logger.info(
            "checkpoint retention (keep_last_n=%d): removed %s", keep_last_n, ", ".join(p.name for p in removed)
        )
    return removed
