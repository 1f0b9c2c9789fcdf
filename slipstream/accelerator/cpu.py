"""CPU: everything runs in program order; memory statistics come from the process RSS."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import resource
import sys
from collections.abc import Callable
from typing import Any

import psutil
import torch

from slipstream.accelerator.abstract import Accelerator

_M_MMAP_THRESHOLD = -3  # mallopt parameter number (malloc.h)
_MIN_MMAP_THRESHOLD, _MAX_MMAP_THRESHOLD = 1 << 20, 32 << 20  # glibc caps the threshold at 32 MiB


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL("libc.so.6")


def _trim_heap() -> None:
    if sys.platform.startswith("linux"):
        try:
            _libc().malloc_trim(0)
        except (OSError, AttributeError):  # not glibc: nothing to trim
            pass


class HeapGuard:
    """Trims the heap only when the process has grown well past its steady state, not every step.

    [Note: trimming the heap, rarely] Activations and per-unit chunks below the mmap threshold
    (see ``return_freed_memory``) come from glibc's heaps, which keep freed pages resident. With
    torch's huge-page allocations (``THP_MEM_ALLOC_ENABLE=1``, which the launcher sets) every block
    of 2 MiB or more is 2 MiB-aligned, and the alignment slack keeps a freed block's hole from
    fitting the next one, so the heap grows step after step: measured on gpt2-large at ZeRO-3 (2
    ranks), ~7 MB per step over 50 steps (torch DDP grows alike). ``malloc_trim(0)`` after every
    step took that back, but every page it returned was faulted in again by the next step: 250 MB
    less peak RSS for 18% more step time. The steady state needs no trim (the next step reuses
    those pages), only the growth does; so the guard records the resident size once the step has
    settled and trims when it has grown by a quarter (at least 256 MiB) beyond it: one ~0.3 s trim
    every few dozen steps on that model, and peak RSS bounded instead of climbing.
    """

    FLOOR = 256 * 2**20

    def __init__(self, resident: Callable[[], int], trim: Callable[[], None], settle_steps: int = 2) -> None:
        self.resident, self.trim, self.settle_steps = resident, trim, settle_steps
        self.steady: int | None = None  # resident bytes after a settled step
        self.since = 0  # steps since start or since the last trim
        self.trims = 0

    def after_step(self) -> None:
        self.since += 1
        if self.since < self.settle_steps:
            return
        now = self.resident()
        if self.steady is None:
            self.steady = now
        elif now - self.steady > max(self.FLOOR, self.steady // 4):
            self.trim()
            self.trims += 1
            self.steady, self.since = None, self.settle_steps - 1  # settle again after one step


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
    runs_ahead_of_host = False

    def __init__(self) -> None:
        self._process = psutil.Process()
        self._peak_baseline = 0
        self._mmap_threshold: int | None = None
        self._heap_guard = HeapGuard(lambda: self._process.memory_info().rss, _trim_heap)

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

    def free_memory(self) -> int:
        return int(psutil.virtual_memory().available)

    def return_freed_memory(self, block_bytes: int) -> None:
        # [Note: glibc and freed units] glibc raises its mmap threshold each time a large block is
        # freed, so later blocks of that size come from the heap, where alignment slack keeps a freed
        # unit's hole from fitting the next one: measured here, releasing 24 gathered 12.6 MB units
        # left 265 MB mapped. A fixed threshold at the block size keeps those blocks on mmap,
        # returned when freed. Not lower: every smaller allocation (activations) would then fault its
        # pages in afresh each step — a 1 MiB threshold made a ZeRO-3 GPT-2 step 35% slower.
        threshold = min(max(block_bytes, _MIN_MMAP_THRESHOLD), _MAX_MMAP_THRESHOLD)
        if sys.platform.startswith("linux") and threshold != self._mmap_threshold:
            try:
                _libc().mallopt(_M_MMAP_THRESHOLD, threshold)
            except (OSError, AttributeError):  # not glibc (musl...): nothing to tune
                return
            self._mmap_threshold = threshold

    def release_freed_memory(self) -> None:
        self._heap_guard.after_step()
