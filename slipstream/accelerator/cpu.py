"""CPU: everything runs in program order; memory statistics come from the process RSS."""

from __future__ import annotations

import contextlib
import resource
import sys
from typing import Any

import psutil
import torch

from slipstream.accelerator.abstract import Accelerator


class _CPUStream:
    """Stand-in for a device stream: CPU kernels already complete in program order."""

    def wait_stream(self, other: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None


class _CPUEvent:
    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class CPUAccelerator(Accelerator):
    name = "cpu"
    communication_backend = "gloo"

    def __init__(self) -> None:
        self._process = psutil.Process()
        self._peak_baseline = 0

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("cpu")

    def set_device(self, index: int) -> None:
        return None

    def device_count(self) -> int:
        return 1

    def synchronize(self) -> None:
        return None

    def new_stream(self) -> _CPUStream:
        return _CPUStream()

    def current_stream(self) -> _CPUStream:
        return _CPUStream()

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext(stream)

    def new_event(self) -> _CPUEvent:
        return _CPUEvent()

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor  # pinning only matters for host-device copies

    def memory_allocated(self) -> int:
        return int(self._process.memory_info().rss)

    def max_memory_allocated(self) -> int:
        # ru_maxrss is KiB on Linux and bytes on macOS; it cannot be reset, so a reset only
        # records the current RSS as the floor.
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = peak if sys.platform == "darwin" else peak * 1024
        return max(int(peak), self._peak_baseline)

    def reset_peak_memory_stats(self) -> None:
        self._peak_baseline = self.memory_allocated()
