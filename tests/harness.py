"""Run a test body on N ranks (gloo) with worker processes that are reused across tests.

[Note: why reuse] Spawning ranks and importing torch/transformers costs seconds per process; a
pool per world size is started once and serves every test. A test body is a module-level function
(picklable by reference) called on every rank; it returns a value per rank or raises.

Failures come back with each rank's traceback. A hang (a rank not answering within the timeout)
dumps every stuck rank's Python stack (faulthandler on SIGUSR1), kills the pool and fails the
test with those stacks; the next test gets a fresh pool.
"""

from __future__ import annotations

import atexit
import datetime
import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

DEFAULT_TIMEOUT_S = float(os.environ.get("SLIPSTREAM_TEST_TIMEOUT", "300"))
GRACE_AFTER_FAILURE_S = 10.0
PROCESS_GROUP_TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(rank: int, world_size: int, port: int, conn: Any, sys_path: list[str], dump_path: str) -> None:
    sys.path[:] = sys_path
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        SLIPSTREAM_ACCELERATOR="cpu",
    )
    dump = open(dump_path, "w")  # noqa: SIM115 - must stay open for faulthandler
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=PROCESS_GROUP_TIMEOUT_S)
    )
    from slipstream.comm import flight
    from slipstream.comm.abort import aborted
    from slipstream.utils.logging import set_rank

    set_rank(rank)
    while True:
        try:
            job = conn.recv()
        except EOFError:
            break
        if job is None:
            break
        fn, args, kwargs = job
        environment = dict(
            os.environ
        )  # hosts edit it (Lightning's DDP set-up writes WORLD_SIZE): the next body gets the pool's
        flight.reset()  # each body's collectives are numbered from 1, as in a fresh job
        try:
            outcome = ("ok", fn(*args, **kwargs))
        except pytest.skip.Exception as err:
            outcome = ("skip", str(err))
        except BaseException:  # noqa: BLE001 - everything goes back to the test
            outcome = ("error", traceback.format_exc())
        try:
            # a rank whose step raised aborted its groups (slipstream/comm/abort.py): the pool cannot serve another body
            conn.send((*outcome, aborted()))
        finally:
            if os.environ != environment:
                os.environ.clear()
                os.environ.update(environment)
        if aborted():
            os._exit(0)  # the groups are aborted: nothing to destroy, and the parent starts a fresh pool
    dist.destroy_process_group()


class WorkerPool:
    """``world_size`` ranks in one gloo process group, waiting for test bodies."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        ctx = multiprocessing.get_context("spawn")
        port = _free_port()
        self.dump_dir = Path(tempfile.mkdtemp(prefix=f"slipstream-pool{world_size}-"))
        self.conns = []
        self.procs = []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, world_size, port, child, list(sys.path), str(self.dump_dir / f"rank{rank}.txt")),
                daemon=True,
                name=f"slipstream-test-rank{rank}",
            )
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> list[Any]:
        name = f"{fn.__module__}.{fn.__qualname__}"
        for conn in self.conns:
            conn.send((fn, args, kwargs))
        results: dict[int, tuple[str, Any]] = {}
        aborted = False
        deadline = time.monotonic() + timeout
        while len(results) < self.world_size:
            waiting = {self.conns[r]: r for r in range(self.world_size) if r not in results}
            ready = multiprocessing.connection.wait(list(waiting), timeout=max(0.0, deadline - time.monotonic()))
            for conn in ready:
                rank = waiting[conn]
                try:
                    status, payload, rank_aborted = conn.recv()
                    results[rank] = (status, payload)
                    aborted = aborted or rank_aborted
                except EOFError:
                    code = self.procs[rank].exitcode
                    results[rank] = ("error", f"rank {rank} process died (exit code {code})")
            if any(status == "error" for status, _ in results.values()):
                deadline = min(deadline, time.monotonic() + GRACE_AFTER_FAILURE_S)
            if not ready and time.monotonic() >= deadline:
                break
        hung = [r for r in range(self.world_size) if r not in results]
        errors = {r: msg for r, (status, msg) in results.items() if status == "error"}
        if hung:
            stacks = self._dump_stacks(hung)
            self.shutdown()
            head = f"{name} on {self.world_size} ranks: rank(s) {hung} did not finish within {timeout:.0f}s"
            if errors:
                head += " after other ranks failed"
            raise pytest.fail.Exception(
                "\n\n".join([head, *(f"--- rank {r} failed:\n{m}" for r, m in errors.items()), stacks]), pytrace=False
            )
        if errors:
            _pool_event(f"shut down the {self.world_size}-rank pool after {name}: rank(s) {sorted(errors)} failed")
            self.shutdown()  # a failed rank may have left collectives half-done; start clean
            raise pytest.fail.Exception(
                f"{name} failed on rank(s) {sorted(errors)} of {self.world_size}:\n\n"
                + "\n".join(f"--- rank {r}:\n{m}" for r, m in sorted(errors.items())),
                pytrace=False,
            )
        if aborted:
            _pool_event(f"shut down the {self.world_size}-rank pool after {name}: a rank aborted its process groups")
            self.shutdown()  # some rank aborted its process groups after a failed step; the next body gets a fresh pool
        skips = [msg for status, msg in results.values() if status == "skip"]
        if skips:
            pytest.skip(skips[0])
        return [results[r][1] for r in range(self.world_size)]

    def _dump_stacks(self, ranks: list[int]) -> str:
        for r in ranks:
            if self.procs[r].is_alive():
                os.kill(self.procs[r].pid, signal.SIGUSR1)
        time.sleep(1.0)
        parts = []
        for r in ranks:
            text = (self.dump_dir / f"rank{r}.txt").read_text() if (self.dump_dir / f"rank{r}.txt").exists() else ""
            parts.append(f"--- rank {r} stack at timeout:\n{text.strip() or '(no stack: process dead)'}")
        return "\n".join(parts)

    def shutdown(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self.procs = []
        self.conns = []


_pools: dict[int, WorkerPool] = {}  # by world size, least recently used first
# [Note: idle pools cost] An idle rank is not free: each of its gloo devices keeps a polling thread, ~4% of a
# core per process measured on the 2-core CI machine, so an idle 8-rank and 4-rank pool took half a core
# from the tests that ran after them. Pools are kept while their ranks fit under this cap; beyond it the
# least recently used pool is shut down (a restart costs a few seconds of imports).
MAX_IDLE_RANKS = 7  # the 1-, 2- and 4-rank pools stay; an 8-rank pool is alone


def run_distributed(
    world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any
) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; returns each rank's result."""
    pool = _pools.pop(world_size, None)
    if pool is None or not pool.procs or not pool.alive():
        for size in list(_pools):
            if sum(_pools) + world_size <= max(MAX_IDLE_RANKS, world_size):
                break
            _pool_event(f"shut down the idle {size}-rank pool to make room for {world_size} ranks")
            _pools.pop(size).shutdown()
        _pool_event(f"starting a {world_size}-rank pool for {fn.__module__}.{fn.__qualname__}")
        pool = WorkerPool(world_size)
    _pools[world_size] = pool  # most recently used last
    return pool.run(fn, *args, timeout=timeout, **kwargs)


def _pool_event(text: str) -> None:
    """With SLIPSTREAM_TEST_POOL_LOG=path, one line per pool start and shutdown (where suite time goes)."""
    path = os.environ.get("SLIPSTREAM_TEST_POOL_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as log:
            log.write(f"{time.strftime('%H:%M:%S')} {text}\n")


@atexit.register
def _shutdown_pools() -> None:
    for pool in _pools.values():
        pool.shutdown()
