"""The engine's checkpointing: save/load calls, asynchronous persistence, interval saves and auto-resume.

[Note: asynchronous saves] ``checkpoint.async``: the training thread captures this rank's state
at the step boundary and returns; a background thread writes and fsyncs the files, reading the
tensors live until the engine's next optimizer step, which first copies whatever is still
unwritten (snapshot.py), and rank 0's thread commits the checkpoint once every rank's
files are there (it polls the shared directory, so the background threads never run a collective
that could interleave with training's). The next save, ``engine.close()`` and interpreter exit
wait for it. A crash meanwhile leaves only a ``.tmp-`` directory: ``latest`` still names the
previous complete checkpoint.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

from slipstream.comm import all_gather_objects
from slipstream.comm.teardown import before_teardown
from slipstream.engine.checkpoint import formats, writer
from slipstream.engine.checkpoint.agree import agree as _agree
from slipstream.engine.checkpoint.capture import Payload, capture, merge_spread_manifest
from slipstream.engine.checkpoint.format import TMP_PREFIX, TRASH_PREFIX
from slipstream.engine.checkpoint.reader import CheckpointError, complete_checkpoints, latest_tag
from slipstream.engine.checkpoint.snapshot import GuardedTensors
from slipstream.engine.checkpoint.tags import check_load_tag, check_tag
from slipstream.engine.checkpoint.target import CheckpointTarget
from slipstream.engine.config import CheckpointConfig, ConfigError
from slipstream.utils.logging import get_logger

logger = get_logger(__name__)

SNAPSHOT_DIR_ENV = "SLIPSTREAM_SNAPSHOT_DIR"  # set by `slipstream run`: this run's directory on /dev/shm
SNAPSHOTS_KEPT = 2  # the newest complete one, and the one being written may replace it
_live: weakref.WeakSet[CheckpointManager] = weakref.WeakSet()


class TargetSource(Protocol):
    """What ``resume`` is handed: anything that can build the :class:`CheckpointTarget` (the engine)."""

    def checkpoint_target(self) -> CheckpointTarget: ...


@atexit.register
def _wait_all() -> None:
    """At interpreter exit: finish background saves; one that failed makes the process exit non-zero.

    [Note: a lost last checkpoint is a failure] The training script has returned, so there is no
    caller left to raise to. Exiting 0 would tell the launcher and the scheduler that the run's
    final checkpoint is safe when it is not: the error goes to stderr and the exit status is 1.
    """
    failed = []
    for manager in list(_live):
        error = manager.wait(raise_errors=False)
        if error is not None:
            failed.append(error)
    if failed:
        print(f"slipstream: the background checkpoint save failed: {failed[0]}; exiting with status 1", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


before_teardown(_wait_all)  # also before comm tears the process groups down, whatever the import order


class CheckpointManager:
    """Owned by one engine; every public method is called on every rank (they are collective)."""

    def __init__(self, config: CheckpointConfig, in_memory: bool = False) -> None:
        """``in_memory``: this manager writes in-memory snapshots: a failed one does not fail the process at exit,
        and their tensor files carry no CRC (see format.write_safetensors)."""
        self.config = config
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._buffers: dict[str, Any] = {}  # CPU snapshot buffers, reused by every async save
        self._guard: GuardedTensors | None = None
        self._lock: writer.TagLock | None = None  # rank 0: held from prepare until the commit ends
        self.last_saved: Path | None = None
        self.last_stall_s = 0.0  # training-thread time of the last save: the call plus its fence
        self.last_write_s = 0.0  # from the save call until this rank's files (and, on rank 0, the commit) are done
        self.resume_s = 0.0  # how long auto_resume took to find and load the checkpoint
        self.in_memory = in_memory
        self.memory = _snapshot_manager(config) if config.in_memory_interval else None
        if not in_memory:
            _live.add(self)

    # ------------------------------------------------------------------ save
    def save(
        self,
        target: CheckpointTarget,
        save_dir: str | Path,
        tag: Any,
        client_state: dict[str, Any] | None,
        save_latest: bool = True,
        pin: Callable[[Any], Any] | None = None,
        synchronize: Callable[[], None] | None = None,
        *,
        exclude_frozen: bool = False,
        mid_window: bool = False,
    ) -> Path:
        """Save ``target`` to ``save_dir/tag``. ``pin`` pins async snapshot buffers, ``synchronize`` waits for device copies.

        ``exclude_frozen`` leaves out parameters that do not require gradients; ``mid_window`` says the
        owner holds accumulated gradients not yet applied (they are not saved: a warning says so).
        """
        started = time.perf_counter()
        self.wait()
        save_dir = Path(save_dir)
        rank, world = dist.get_rank(), dist.get_world_size()
        counters = target.counters.record()
        tag = check_tag(tag if tag is not None else f"global_step{counters.global_steps}", "save_checkpoint")
        self._validate_tag(tag, world)
        if mid_window:  # not micro_steps % gas: training hosts force early boundaries (an epoch's end)
            logger.warning(
                "save_checkpoint at micro-step %d, inside an accumulation window: the gradients accumulated so far are "
                "not saved (save right after engine.step() at a boundary)",
                counters.micro_steps,
            )
        # e.g. a client_state value that needs pickle: rank 0 alone captures it, every rank must raise
        # [Note: snapshots without collectives] An in-memory snapshot has no client state, its
        # directory is this run's alone (no lock, no other job's leftovers) and resume() cleared the
        # dead attempts' partial ones; so each rank makes the directory itself and no collective
        # is spent per step (two all_gather_objects were 80% of a small model's snapshot stall).
        run = (lambda action, what: action()) if self.in_memory else _agree
        payload = run(lambda: capture(target, rank, tag, client_state, exclude_frozen), "capturing the state to save")
        if target.spread:
            merge_spread_manifest(payload, target, exclude_frozen)
        tmp = writer.temp_dir(save_dir, tag)
        if self.in_memory:
            tmp.mkdir(parents=True, exist_ok=True)
        else:
            self._lock = _agree(
                lambda: writer.prepare(save_dir, tag) if rank == 0 else None, "preparing the checkpoint directory"
            )
        final = save_dir / tag
        if self.config.async_save:
            self._guard = payload.tensors = GuardedTensors(payload.tensors, self._buffers, pin)
            if synchronize is not None:
                synchronize()  # device-to-host copies are complete before training goes on
            self._thread = threading.Thread(
                target=self._persist,
                args=(payload, save_dir, tag, tmp, world, save_latest, started),
                name=f"slipstream-save-{tag}",
                daemon=False,
            )
            self._thread.start()
        else:
            try:
                _agree(
                    lambda: writer.write_rank(tmp, payload, checksum=not self.in_memory),
                    "writing this rank's checkpoint files",
                )
                if rank == 0:
                    _agree(
                        lambda: self._commit(payload, save_dir, tag, tmp, world, save_latest),
                        "committing the checkpoint",
                    )
                else:
                    _agree(lambda: None, "committing the checkpoint")
            finally:
                self._release()
            logger.info("saved checkpoint %s", final)
            self.last_write_s = time.perf_counter() - started
        self.last_saved = final
        self.last_stall_s = time.perf_counter() - started
        return final

    def before_update(self) -> None:
        """The engine is about to change weights and optimizer state: a background save must not read them live any more."""
        if self._guard is not None:
            self.last_stall_s += self._guard.fence()
            self._guard = None
        if self.memory is not None:
            self.memory.before_update()

    def snapshot_due(self, global_steps: int) -> bool:
        """``checkpoint.in_memory_interval``: whether the step just finished is snapshotted into shared memory."""
        return self.memory is not None and global_steps % self.config.in_memory_interval == 0

    def snapshot(
        self, target: CheckpointTarget, pin: Callable[[Any], Any] | None, synchronize: Callable[[], None] | None
    ) -> None:
        """Snapshot into this node's shared memory, written in the background while training goes on.

        [Note: in-memory snapshots] A snapshot is an ordinary checkpoint (same writer, same atomic
        commit, same reader) whose directory is on tmpfs: it outlives the ranks (a SIGKILLed rank,
        a restart of every rank by the agent) but not the node, and costs a memory copy instead of
        storage bandwidth. A failed snapshot is logged and training continues: the disk checkpoints
        are the durable ones, and auto_resume takes whichever of the two is newer.
        """
        assert self.memory is not None
        error = self.memory.wait(raise_errors=False)
        if error is not None:
            logger.warning(
                "in-memory snapshot failed (training goes on; the previous snapshot and save_dir remain): %s", error
            )
        assert self.memory.config.save_dir is not None
        self.memory.save(target, self.memory.config.save_dir, None, None, True, pin, synchronize)

    def _persist(
        self, payload: Payload, save_dir: Path, tag: str, tmp: Path, world: int, save_latest: bool, started: float
    ) -> None:
        try:
            writer.write_rank(tmp, payload, checksum=not self.in_memory)
            if payload.rank == 0:
                self._commit(payload, save_dir, tag, tmp, world, save_latest)
                logger.info("saved checkpoint %s (in the background)", save_dir / tag)
            self.last_write_s = time.perf_counter() - started
        except BaseException as err:  # noqa: BLE001 - reported on the training thread at the next wait
            logger.error("background checkpoint save of %s failed: %s", tag, err)
            self._error = err
        finally:
            self._release()

    def _release(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    def _commit(self, payload: Payload, save_dir: Path, tag: str, tmp: Path, world: int, save_latest: bool) -> None:
        assert payload.manifest is not None
        writer.commit(
            save_dir,
            tag,
            tmp,
            world,
            payload.manifest,
            save_latest,
            self.config.commit_timeout,
            self.config.keep_last_n,
        )

    def wait(self, raise_errors: bool = True) -> BaseException | None:
        """Block until the background save (if any) is on disk; re-raise its failure (or return it)."""
        if self.memory is not None:
            self.memory.wait(raise_errors=False)
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        self._guard = None
        error, self._error = self._error, None
        if error is not None and raise_errors:
            raise CheckpointError(f"the background checkpoint save failed: {error}") from error
        return error

    def _validate_tag(self, tag: str, world: int) -> None:
        mode = self.config.tag_validation
        if mode == "Ignore" or world == 1:
            return
        tags = all_gather_objects(tag)
        if len(set(tags)) > 1:
            message = (
                f"save_checkpoint: ranks passed different tags {sorted(set(tags))}; pass the same tag on every rank"
            )
            if mode == "Fail":
                raise ValueError(message + " (checkpoint.tag_validation is Fail)")
            logger.warning(message)

    # ------------------------------------------------------------------ load
    def load(
        self,
        target: CheckpointTarget,
        load_dir: str | Path,
        tag: Any,
        *,
        strict: bool = True,
        optimizer: bool = True,
        scheduler: bool = True,
        module_only: bool = False,
    ) -> tuple[str | None, dict[str, Any] | None]:
        self.wait()
        if tag is not None:
            tag = check_load_tag(tag, "load_checkpoint")
        found = _agree(lambda: formats.detect(load_dir, tag, self.config.verify_checksums), "finding the checkpoint")
        if found is None:
            logger.warning("load_checkpoint: no checkpoint in %s; nothing loaded", load_dir)
            return None, None
        kind, path = found
        request = formats.LoadRequest(
            target, strict, optimizer, scheduler, module_only, verify_checksums=self.config.verify_checksums
        )
        return kind.load(request, path)

    # ------------------------------------------------------------------ config-driven saves
    def resume(self, source: TargetSource) -> tuple[str | None, dict[str, Any] | None]:
        """``checkpoint.auto_resume``: load the newest complete checkpoint in ``save_dir``, or a newer in-memory snapshot."""
        assert self.config.save_dir is not None
        started = time.perf_counter()
        save_dir = Path(self.config.save_dir)
        snapshot = self._newer_snapshot(save_dir)
        if snapshot is not None:
            loaded = self.load(source.checkpoint_target(), snapshot, None)
        elif latest_tag(save_dir) is None and not complete_checkpoints(save_dir):
            logger.info("auto_resume: no checkpoint in %s yet; starting from scratch", save_dir)
            return None, None
        else:
            loaded = self.load(source.checkpoint_target(), save_dir, None)
        self.resume_s = time.perf_counter() - started
        logger.info("auto_resume: restored %s in %.2f s", loaded[0], self.resume_s)
        return loaded

    def _newer_snapshot(self, save_dir: Path) -> Path | None:
        """The newest in-memory snapshot if it is newer than every complete checkpoint in ``save_dir`` (on every rank)."""
        if self.memory is None:
            return None
        assert self.memory.config.save_dir is not None
        directory = Path(self.memory.config.save_dir)
        if (
            dist.get_rank() == 0 and directory.is_dir()
        ):  # a killed attempt's partial snapshots: no rank writes before the gather below
            for child in directory.iterdir():
                if child.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
                    shutil.rmtree(child, ignore_errors=True)
        snapshots = complete_checkpoints(directory)
        on_disk = complete_checkpoints(save_dir)
        newest = snapshots[-1] if snapshots else None
        disk_steps = on_disk[-1][1].get("global_steps", 0) if on_disk else -1
        choice = str(newest[0]) if newest is not None and newest[1].get("global_steps", 0) > disk_steps else None
        if len(set(all_gather_objects(choice))) > 1:  # ranks see different snapshots: only the disk is common ground
            logger.warning(
                "auto_resume: the ranks found different in-memory snapshots; resuming from %s instead", save_dir
            )
            return None
        if choice is not None:
            logger.info(
                "auto_resume: in-memory snapshot at step %d is newer than %s's (step %d)",
                newest[1].get("global_steps", 0),
                save_dir,
                disk_steps,
            )  # type: ignore[index]
        return Path(choice) if choice is not None else None

    def due(self, global_steps: int) -> bool:
        """``checkpoint.interval``: whether the step just finished should be saved into ``save_dir``."""
        every = self.config.interval
        return bool(every) and global_steps % every == 0 and self.config.save_dir is not None


def _snapshot_manager(config: CheckpointConfig) -> CheckpointManager:
    """The manager that writes ``in_memory_interval`` snapshots: asynchronous, the newest two kept, untracked at exit."""
    directory = config.in_memory_dir or os.environ.get(SNAPSHOT_DIR_ENV)
    if not directory:
        raise ConfigError(
            "checkpoint.in_memory_interval: no shared-memory directory for the snapshots; launch with `slipstream run` "
            "(it makes one per run on /dev/shm) or set checkpoint.in_memory_dir"
        )
    local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
    if config.in_memory_dir is None and local is not None and world is not None and local != world:
        raise ConfigError(
            f"checkpoint.in_memory_interval: this job spans several nodes ({world} ranks, {local} per node) and each node's "
            "/dev/shm is its own; snapshots are not replicated to a peer node yet: use disk checkpoints (checkpoint.interval), "
            "or set checkpoint.in_memory_dir to a directory every rank shares"
        )
    memory = config.model_copy(
        update={
            "save_dir": directory,
            "keep_last_n": SNAPSHOTS_KEPT,
            "async_save": True,
            "interval": 0,
            "in_memory_interval": 0,
            "auto_resume": False,
            "tag_validation": "Ignore",
        }
    )
    return CheckpointManager(memory, in_memory=True)
