"""Where a rank's resident memory is at its peak: RSS and PSS, malloc's heap and mmap'd blocks, shared memory.

``ru_maxrss`` gives the peak RSS for free, but not what it was made of, and RSS counts a shared page
in every process that maps it. :class:`PeakSampler` polls ``/proc/self/smaps_rollup`` and glibc's
``mallinfo2`` on a thread while a few (untimed) steps run and keeps the sample with the highest RSS
and the highest PSS. Linux and glibc only; elsewhere the fields it cannot read stay zero.
"""

from __future__ import annotations

import ctypes
import functools
import threading
import time

MIB = 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


@functools.cache
def _libc_mallinfo2() -> ctypes._CFuncPtr | None:
    """glibc's ``mallinfo2`` (every arena summed), loaded once: the sampler and the tests call it very often."""
    try:
        function = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):  # not glibc, or older than 2.33
        return None
    function.restype = _MallInfo2
    return function


def _large_blocks() -> dict[str, int]:
    """The CPU blocks slipstream maps on their own, outside malloc (``slipstream/ops/large_blocks.py``): live bytes
    (``mapped_bytes``) and those freed and cached for reuse (``cached_bytes``)."""
    from slipstream.ops import large_blocks

    return large_blocks.stats()


def malloc_in_use() -> int:
    """Bytes the allocators have handed out and not had back: malloc's heap chunks in use and mmap'd blocks, plus the
    large blocks slipstream maps itself (0 where malloc's figures are unknown)."""
    mallinfo2 = _libc_mallinfo2()
    if mallinfo2 is None:
        return 0
    info = mallinfo2()
    return int(info.uordblks + info.hblkhd) + _large_blocks()["mapped_bytes"]


def _mallinfo() -> dict[str, float]:
    mallinfo2 = _libc_mallinfo2()
    if mallinfo2 is None:
        return {}
    info, large = mallinfo2(), _large_blocks()
    # uordblks: bytes in use in the heaps; fordblks: free bytes the heaps keep; hblkhd: bytes in mmap'd blocks (malloc's
    # and the large blocks slipstream maps itself); large_cached: freed large blocks slipstream keeps for reuse
    return {
        "heap_used": info.uordblks / MIB,
        "heap_free": info.fordblks / MIB,
        "mmapped": (info.hblkhd + large["mapped_bytes"]) / MIB,
        "large_cached": large["cached_bytes"] / MIB,
    }


def _rollup() -> dict[str, float]:
    fields = {
        "Rss:": "rss",
        "Pss:": "pss",
        "Pss_Shmem:": "pss_shmem",
        "Shared_Clean:": "shared",
        "Shared_Dirty:": "shared",
        "AnonHugePages:": "huge",
    }
    found = dict.fromkeys(fields.values(), 0.0)
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if parts and parts[0] in fields:
                    found[fields[parts[0]]] += int(parts[1]) / 1024
    except OSError:
        pass
    return found


def shm_rss_mib() -> float:
    """Resident MiB of this process's mappings of ``/dev/shm`` files (the shared-memory collectives)."""
    total, in_shm = 0.0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 5 and "-" in parts[0] and ":" in parts[3]:  # a mapping's header line
                    in_shm = len(parts) > 5 and parts[5].startswith("/dev/shm")
                elif in_shm and parts[0] == "Rss:":
                    total += int(parts[1]) / 1024
    except OSError:
        pass
    return total


def sample() -> dict[str, float]:
    return {**_rollup(), **_mallinfo()}


class PeakSampler:
    """``with PeakSampler() as peak:`` polls every ``interval`` seconds; ``peak.at_rss`` / ``peak.pss`` / ``peak.live``
    (the most bytes the allocators had handed out, MiB: what an estimate of live tensors predicts) afterwards."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.at_rss: dict[str, float] = {}
        self.pss = 0.0
        self.live = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            now = sample()
            if now["rss"] > self.at_rss.get("rss", -1.0):
                self.at_rss = now
            self.pss = max(self.pss, now["pss"])
            self.live = max(self.live, now.get("heap_used", 0.0) + now.get("mmapped", 0.0))
            time.sleep(self.interval)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
