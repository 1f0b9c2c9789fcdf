"""The device interface everything above this layer uses instead of ``torch.cuda``."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class Accelerator(abc.ABC):
    """One kind of device: its name, streams and events, pinned memory and memory statistics."""

    name: str
    communication_backend: str
    # Kernels run behind the host (CUDA streams): reading a device value waits for everything queued before it.
    # False where work runs in program order (CPU), so such a read costs nothing.
    runs_ahead_of_host: bool = True

    @abc.abstractmethod
    def device(self, index: int | None = None) -> torch.device: ...

    @abc.abstractmethod
    def set_device(self, index: int) -> None: ...

    @abc.abstractmethod
    def device_count(self) -> int: ...

    @abc.abstractmethod
    def synchronize(self) -> None: ...

    def device_name(self) -> str:
        """The device's marketing name (for the monitor's peak-FLOPs table); empty where unknown."""
        return ""

    # Streams and events. On CPU, work runs in order and communication on the backend's threads,
    # so these are cheap stand-ins with the same call shape.
    @abc.abstractmethod
    def new_stream(self) -> Any: ...

    @abc.abstractmethod
    def current_stream(self) -> Any: ...

    @abc.abstractmethod
    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]: ...

    @abc.abstractmethod
    def new_event(self) -> Any: ...

    @abc.abstractmethod
    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def pinned_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D CPU tensor for host-device copies: page-locked where that makes them faster and async."""
        return torch.empty(numel, dtype=dtype)

    @abc.abstractmethod
    def memory_allocated(self) -> int:
        """Bytes currently held by tensors on this device (process RSS on CPU)."""

    @abc.abstractmethod
    def max_memory_allocated(self) -> int:
        """Peak of :meth:`memory_allocated` since start or the last reset."""

    @abc.abstractmethod
    def reset_peak_memory_stats(self) -> None: ...

    @abc.abstractmethod
    def free_memory(self) -> int:
        """Bytes this device could still give a new allocation now (the host's available memory on CPU)."""

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def rng_state(self) -> torch.Tensor | None:
        """The device's random generator state beyond torch's CPU one (saved in checkpoints); None on CPU."""
        return None

    def set_rng_state(self, state: torch.Tensor) -> None:
        """Restore what :meth:`rng_state` returned."""

    def return_freed_memory(self, block_bytes: int) -> None:
        """Make freed blocks of ``block_bytes`` or more (ZeRO-3 releasing a unit) leave the process.

        Device caching allocators reuse it already; nothing to do by default.
        """

    def release_freed_memory(self) -> None:
        """After each step: hand memory the process freed but still holds back to the system where it has grown
        past the steady state (CPU: see ``HeapGuard``); never per unit.

        Device caching allocators keep it on purpose for the next step: nothing to do by default.
        """

    def supports_fused_adam(self) -> bool:
        """Whether ``torch.optim.AdamW(fused=True)`` runs on this device."""
        return True

    @contextlib.contextmanager
    def wait_stream_on_exit(self, stream: Any) -> Iterator[None]:
        """Run a block on ``stream`` and make the current stream wait for it afterwards."""
        current = self.current_stream()
        with self.stream(stream):
            yield
        current.wait_stream(stream)
