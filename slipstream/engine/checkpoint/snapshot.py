"""The state an asynchronous save writes: read live until the next optimizer step, then from copies.

[Note: copy only what is still needed] Between a save and the next optimizer step, training only
*reads* the saved tensors (weights, fp32 masters, optimizer state): forward and backward write
gradients, which are not saved. So the background writer streams CPU tensors straight from their
live storage, and only when the engine is about to step (``fence``) are the tensors it has not
written yet copied to CPU buffers, while the one being written is finished first. If the write
is done by then, as it usually is, the training thread never copies anything: the stall is the
metadata capture alone. Device tensors (and small ones, such as buffers that a forward may update)
are copied at the save call, to pinned memory on CUDA.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy
import torch

SMALL = 1 << 20  # bytes: tensors this small are copied at once (cheap, and e.g. BatchNorm buffers change in forward)


class GuardedTensors:
    """Tensors for :func:`write_safetensors`: live views until :meth:`fence`, CPU copies after."""

    def __init__(
        self,
        live: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        pin: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> None:
        self._buffers, self._pin = buffers, pin
        self._live = live
        self._copies: dict[str, torch.Tensor] = {}
        self._done: set[str] = set()
        self._inflight: str | None = None
        self._fenced = False
        self._cond = threading.Condition()
        for key, t in live.items():
            if t.device.type != "cpu" or t.numel() * t.element_size() <= SMALL:
                self._copies[key] = self._copy(key, t)
        for stale in set(buffers) - set(live):
            del buffers[stale]

    def _copy(self, key: str, t: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            if self._pin is not None and t.device.type != "cpu":
                buf = self._pin(buf)
            self._buffers[key] = buf
        if t.device.type == "cpu" and t.numel():
            # One thread, GIL released: torch's copy_ splits over intra-op threads, which on a busy
            # machine made the copy 5-10x slower than a plain memcpy.
            numpy.copyto(_bytes(buf), _bytes(t))
        else:
            buf.copy_(t.detach(), non_blocking=t.device.type != "cpu")
        return buf

    # the mapping the writer iterates (shapes and dtypes for the header)
    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._live.items())

    def values(self) -> Iterator[torch.Tensor]:
        return iter(self._live.values())

    def __iter__(self) -> Iterator[str]:
        return iter(self._live)

    def __len__(self) -> int:
        return len(self._live)

    @contextlib.contextmanager
    def reading(self, key: str) -> Iterator[torch.Tensor]:
        """The tensor to write for ``key``; the live one stays untouched until this block ends."""
        with self._cond:
            source = self._copies.get(key, self._live[key])
            self._inflight = key
        try:
            yield source
        finally:
            with self._cond:
                self._inflight = None
                self._done.add(key)
                self._cond.notify_all()

    def fence(self) -> float:
        """Called before the live tensors change: copy what is unwritten, finish the tensor being written. Returns seconds spent."""
        start = time.perf_counter()
        with self._cond:
            if self._fenced:
                return 0.0
            self._fenced = True
            for key, t in self._live.items():
                if key not in self._done and key != self._inflight and key not in self._copies:
                    self._copies[key] = self._copy(key, t)
            while self._inflight is not None and self._inflight not in self._copies:
                self._cond.wait()
        return time.perf_counter() - start


def _bytes(t: torch.Tensor) -> numpy.ndarray:
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def reading(tensors: Any, key: str) -> contextlib.AbstractContextManager[torch.Tensor]:
    """``tensors[key]`` for the writer, through :meth:`GuardedTensors.reading` when guarded."""
    if isinstance(tensors, GuardedTensors):
        return tensors.reading(key)
    return contextlib.nullcontext(tensors[key])
