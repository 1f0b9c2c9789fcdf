"""Process-group set-up from torchrun-style environment variables."""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

from slipstream.accelerator import get_accelerator
from slipstream.utils.logging import get_logger, set_rank

logger = get_logger(__name__)

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
_timeout = DEFAULT_TIMEOUT


def current_timeout() -> datetime.timedelta:
    """The collective timeout the default group was created with (groups we add inherit it)."""
    return _timeout


def init_distributed(backend: str | None = None, timeout: datetime.timedelta | float | None = None) -> None:
    """Join (or create) the default process group.

    Reads ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` as set by
    ``slipstream run`` or ``torchrun``. With none of them set, a single-process group is created so
    the same code runs unchanged on a laptop. Does nothing if a group already exists.
    ``backend`` defaults to the accelerator's (nccl on CUDA, gloo on CPU).
    """
    global _timeout
    if dist.is_initialized():
        set_rank(dist.get_rank())
        if timeout is not None:
            _apply_timeout(timeout)
        return
    accelerator = get_accelerator()
    backend = backend or accelerator.communication_backend
    if isinstance(timeout, (int, float)):
        timeout = datetime.timedelta(seconds=timeout)
    timeout = _timeout = timeout or DEFAULT_TIMEOUT
    if accelerator.name == "cuda":
        accelerator.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "WORLD_SIZE" not in os.environ and "RANK" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise RuntimeError(
                f"init_distributed: environment variables {', '.join(missing)} are not set; launch with "
                "`slipstream run --nproc_per_node N script.py` (or torchrun), or set RANK, WORLD_SIZE, "
                "MASTER_ADDR and MASTER_PORT"
            )
        store = _attempt_store(timeout)
        if store is None:
            dist.init_process_group(backend, init_method="env://", timeout=timeout)
        else:
            rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    set_rank(dist.get_rank())
    logger.debug("joined process group: rank %d of %d, backend %s", dist.get_rank(), dist.get_world_size(), backend)


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
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
        is_master=False, timeout=timeout,
    )  # fmt: skip
    return dist.PrefixStore(f"slipstream/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", client)


def _apply_timeout(timeout: datetime.timedelta | float) -> None:
    """Give a process group created elsewhere (torchrun user code, a test harness) our timeout.

    Without this, ``comms_timeout_seconds`` would only reach groups slipstream creates itself and a
    desynchronized rank would hang for the 30 minutes torch defaults to.
    """
    global _timeout
    if isinstance(timeout, (int, float)):
        timeout = datetime.timedelta(seconds=timeout)
    _timeout = timeout
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is None:  # older torch: only the groups created from now on get it
        logger.warning("this torch cannot change an existing process group's timeout; comms_timeout_seconds "
                       "applies to slipstream's own groups only")  # fmt: skip
        return
    set_timeout(timeout, dist.group.WORLD)


def get_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1
