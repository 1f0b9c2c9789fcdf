"""Process-group set-up from torchrun-style environment variables."""

from __future__ import annotations

import datetime
import os
import re
import reprlib
from collections.abc import Mapping

import torch.distributed as dist

from slipstream.accelerator import get_accelerator
from slipstream.comm import watch
from slipstream.comm.process import DEFAULT_TIMEOUT, PROCESS
from slipstream.errors import SlipstreamError
from slipstream.utils.logging import get_logger, set_rank

logger = get_logger(__name__)

_LAUNCHED_BY = "`slipstream run` and torchrun set it for each process"
_MAX_C10D_INT = 2**31 - 1  # c10d keeps ranks and world sizes in a C int


class LaunchEnvError(SlipstreamError, RuntimeError):
    """A launch variable (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) that is
    missing or malformed; the message names the variable, its value and what is allowed."""


RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=5)  # the slowest rank's start ([Note: joining is not a collective])


def current_timeout() -> datetime.timedelta:
    """The collective timeout the default group was created with (groups we add inherit it)."""
    return PROCESS.timeout


def init_distributed(backend: str | None = None, timeout: datetime.timedelta | float | None = None) -> None:
    """Join (or create) the default process group.

    Reads ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` as set by
    ``slipstream run`` or ``torchrun``. With none of them set, a single-process group is created so
    the same code runs unchanged on a laptop. Does nothing if a group already exists.
    ``backend`` defaults to the accelerator's (nccl on CUDA, gloo on CPU).
    """
    watch.install()  # the flight recorder sees the user's collectives too (watch.py)
    if dist.is_initialized():
        set_rank(dist.get_rank())
        if timeout is not None:
            _apply_timeout(timeout)
        return
    check_launch_env(os.environ)
    accelerator = get_accelerator()
    backend = backend or accelerator.communication_backend
    if isinstance(timeout, (int, float)):
        timeout = datetime.timedelta(seconds=timeout)
    timeout = PROCESS.timeout = timeout or DEFAULT_TIMEOUT
    if accelerator.name == "cuda":
        local_rank, devices = int(os.environ.get("LOCAL_RANK", "0")), accelerator.device_count()
        if local_rank >= devices:  # torch would say only "invalid device ordinal"
            raise LaunchEnvError(
                f"LOCAL_RANK={local_rank} is not below this node's {devices} visible CUDA device(s); start at most "
                f"{devices} process(es) per node (--nproc_per_node) or check CUDA_VISIBLE_DEVICES"
            )
        accelerator.set_device(local_rank)
    # [Note: joining is not a collective] Ranks start apart: imports (torch, transformers), a model
    # built before initialize, a loaded machine. The configured timeout is for a collective a peer never
    # joins; the rendezvous waits up to RENDEZVOUS_TIMEOUT for the slowest starter (with a 5 s comms
    # timeout, 4 ranks on a busy 2-core machine failed in init_process_group's store wait), then the
    # group gets the configured timeout.
    joining = max(timeout, RENDEZVOUS_TIMEOUT)
    if "WORLD_SIZE" not in os.environ and "RANK" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        store = _attempt_store(joining)
        if store is None:
            dist.init_process_group(backend, init_method="env://", timeout=joining)
        else:
            rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=joining)
        if joining != timeout:
            _apply_timeout(timeout)
            dist.distributed_c10d._get_default_store().set_timeout(timeout)  # store waits are the job's too
    set_rank(dist.get_rank())
    logger.debug("joined process group: rank %d of %d, backend %s", dist.get_rank(), dist.get_world_size(), backend)


def check_launch_env(environ: Mapping[str, str]) -> None:
    """Refuse a missing or malformed launch variable with one line that names it, before any socket opens.

    Unchecked, ``WORLD_SIZE=abc`` surfaces as a bare ``invalid literal for int()``, and ``MASTER_PORT=99999``,
    ``RANK=2`` of ``WORLD_SIZE=2`` or an empty ``MASTER_ADDR`` as a C++ rendezvous error or a timeout minutes
    later; neither names the variable. With neither ``RANK`` nor ``WORLD_SIZE`` set the job is a single
    process and only ``LOCAL_RANK`` (if set) is read.
    """
    if "LOCAL_RANK" in environ:
        _launch_int(environ, "LOCAL_RANK", 0, "a non-negative integer (this process's index on its node)")
    if "WORLD_SIZE" not in environ and "RANK" not in environ:
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in environ]
    if missing:
        raise LaunchEnvError(
            f"init_distributed: environment variables {', '.join(missing)} are not set; launch with "
            "`slipstream run --nproc_per_node N script.py` (or torchrun), or set RANK, WORLD_SIZE, "
            "MASTER_ADDR and MASTER_PORT"
        )
    world_size = _launch_int(environ, "WORLD_SIZE", 1, "a positive integer (the number of processes)")
    rank = _launch_int(environ, "RANK", 0, "a non-negative integer (this process's rank)")
    if rank >= world_size:
        raise LaunchEnvError(f"RANK={rank} is not below WORLD_SIZE={world_size}: ranks run from 0 to {world_size - 1}")
    _launch_int(environ, "MASTER_PORT", 1, "an integer in 1..65535 (the port rank 0 listens on)", high=65535)
    if not re.fullmatch(r"\S+", environ["MASTER_ADDR"]):
        raise LaunchEnvError(
            f"MASTER_ADDR={reprlib.repr(environ['MASTER_ADDR'])}: must be rank 0's host name or IP address, "
            f"with no spaces; {_LAUNCHED_BY}"
        )


def _launch_int(environ: Mapping[str, str], name: str, low: int, allowed: str, high: int = _MAX_C10D_INT) -> int:
    """``environ[name]`` as an int in low..high, or a :class:`LaunchEnvError` saying ``allowed``."""
    text = environ[name].strip()
    # ASCII digits only (str.isdigit() takes '²', which int() refuses); the length check first, because
    # int() of thousands of digits raises instead of converting.
    if re.fullmatch(r"[0-9]+", text) and len(text.lstrip("0")) <= len(str(high)) and low <= int(text) <= high:
        return int(text)
    raise LaunchEnvError(f"{name}={reprlib.repr(environ[name])}: must be {allowed}; {_LAUNCHED_BY}")


def _attempt_store(timeout: datetime.timedelta) -> dist.Store | None:
    """The launcher's store, seen through a namespace of its own for this restart attempt.

    [Note: one store namespace per attempt] Under torch elastic (``slipstream run``, torchrun)
    the ranks share the agent's TCPStore (``TORCHELASTIC_USE_AGENT_STORE``), and the agent keeps
    that store across restarts. torch's ``env://`` set-up writes the same keys in every attempt,
    so after a restart a rank can read a dead peer's address from the previous attempt and fail
    ("Connection refused") or hang while connecting. Prefixing the keys with the attempt number
    (``TORCHELASTIC_RESTART_COUNT``, equal on every rank of an attempt) gives each attempt a clean
    namespace. Outside torch elastic this returns None and ``env://`` is used as usual.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(f"slipstream/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", client)


def _apply_timeout(timeout: datetime.timedelta | float) -> None:
    """Give a process group created elsewhere (torchrun user code, a test harness) our timeout.

    Without this, ``comms_timeout_seconds`` would only reach groups slipstream creates itself and a
    desynchronized rank would hang for the 30 minutes torch defaults to.
    """
    if isinstance(timeout, (int, float)):
        timeout = datetime.timedelta(seconds=timeout)
    PROCESS.timeout = timeout
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is None:  # older torch: only the groups created from now on get it
        logger.warning(
            "this torch cannot change an existing process group's timeout; comms_timeout_seconds "
            "applies to slipstream's own groups only"
        )
        return
    set_timeout(timeout, dist.group.WORLD)


def get_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1
