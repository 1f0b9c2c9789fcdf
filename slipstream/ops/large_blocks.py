"""Large CPU blocks on mappings of their own: a process's resident size follows what it uses.

[Note: large blocks leave the heap] torch allocates CPU tensors with glibc's ``malloc``. glibc
serves a block from its heaps once its dynamic mmap threshold has risen past the block's size (a
freed mapped block raises it, up to 32 MiB), and a heap keeps freed pages resident. A training
step frees its activations and their gradients in another order than it made them, so the holes
they leave do not fit the next blocks and the heap grows past what is in use: measured on
gpt2-large at 2 ranks without huge pages, 300-440 MiB of free heap beside a 700 MiB working set,
different from run to run; under Ulysses at 16k tokens, 48 KB per token beyond the live tensors.
Pinning glibc's threshold lower returns those blocks, but each one is then mapped and faulted in
4 KiB pages afresh (1.18x the step time at 4 MiB).

The compiled op (``csrc/alloc/large_blocks.cpp``) becomes torch's CPU allocator: a block of at
least ``threshold`` bytes gets a mapping of its own, aligned on a 2 MiB boundary and advised
``MADV_HUGEPAGE`` (its length rounded to whole huge pages where that wastes at most an eighth of it,
else to 64 KiB: a touched huge page is resident whole); smaller blocks go to the allocator it replaced. A freed block waits in
a cache for the next block of its size (a step makes the same sizes as the one before), so it is
neither unmapped nor faulted in and zeroed again: a fresh mapping per block had cost 1.15-1.29x
DDP's step at 2 ranks. The cache never holds more than the most live bytes there ever were, less
what is live now ([Note: the cache holds only what the peak already paid for] in the source), so
the large blocks' resident size never rises above the peak an allocator that unmaps at once would
reach; after each optimizer step it also unmaps what that step did not take again. It is installed
only where the kernel offers transparent huge pages (``always`` or ``madvise``): without them every
new block would fault in 4 KiB pages. ``SLIPSTREAM_LARGE_BLOCKS`` sets the threshold in bytes
(``DEFAULT_THRESHOLD`` when unset); ``0`` keeps glibc for everything.

[Note: why 1 MiB] The threshold decides which blocks glibc's heap still serves, and the heap keeps
its own freed pages under its own high water, beside the cache's: from 4 MiB, what the heap kept of
the step's 1-4 MiB activations was 105-136 MiB at the highest RSS of the gpt2-large workload (no
huge pages), peak RSS 7-9% above the estimate at ZeRO 0 and 3 (9-13% at stages 1-3 without the
collectives' rings). From 1 MiB the heap keeps 2-10 MiB, stage 3 peaks 48-60 MiB lower at 2 and 4
ranks, and the estimate is within 2-6% at stages 0-3 (benchmarks/README.md, 2026-12-03). The cost
is churn: blocks freed before the step's peak and wanted after it are unmapped to keep the cache
under the high water and mapped again, 27 mappings a step at stage 3 against 15; over nine rounds
side by side stage 3's step took 0.82-1.11 of the 4 MiB one, median 1.03. Below 1 MiB the blocks
are many and short-lived; glibc's own mmap threshold starts at 128 KiB.

[Note: on by default] An earlier cache, emptied at each backward and trimmed per step, was opt-in:
with it on, the fresh-clone suite failed the NVMe offload capacity test (peak RSS growth 384 MB
against its 320 MiB cap: the cache held freed swap buffers), and a long-context run with tiled
logits peaked 200 MB above the uncached version. Bounded by the high water, the capacity test's
growth is 293-296 MB (282-283 on glibc; 294-296 from 1 MiB); see benchmarks/README.md for the step times and peaks.

Only over glibc's ``malloc`` and torch's default CPU allocator (see :func:`glibc_malloc`). Tensors
made before it was installed keep their own deleter, so installing and uninstalling are safe at
any time.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path
from typing import Any

from slipstream.ops import builder
from slipstream.ops.specs import LARGE_BLOCKS
from slipstream.utils.logging import get_logger

__all__ = [
    "DEFAULT_THRESHOLD",
    "glibc_malloc",
    "install",
    "installed",
    "reset_high_water",
    "stats",
    "thp_available",
    "trim",
    "uninstall",
]

logger = get_logger(__name__)

DEFAULT_THRESHOLD = 1 << 20  # [Note: why 1 MiB]
_installed_threshold = 0  # what install() last installed (0: not installed by us)
_module: Any = None  # the op, once install() loaded it (trim() runs every step: no lookup there)
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_available(setting: Path = _THP_SETTING) -> bool:
    """Whether ``madvise(MADV_HUGEPAGE)`` gets huge pages here: the kernel's THP mode is ``always`` or ``madvise``."""
    try:
        text = setting.read_text()
    except OSError:
        return False
    return "[always]" in text or "[madvise]" in text


def configured_threshold() -> int:
    """``SLIPSTREAM_LARGE_BLOCKS`` in bytes; unset: :data:`DEFAULT_THRESHOLD`; 0: off (glibc for every block); a
    value that is not an integer is an error."""
    raw = os.environ.get("SLIPSTREAM_LARGE_BLOCKS")
    if raw is None or not raw.strip():
        return DEFAULT_THRESHOLD
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"SLIPSTREAM_LARGE_BLOCKS: {raw!r} is not a number of bytes (0 turns it off)") from None
    if value != 0 and value < 4096:
        raise ValueError(f"SLIPSTREAM_LARGE_BLOCKS: {value} is below one page (4096 bytes); 0 turns it off")
    return value


def install(threshold: int | None = None) -> bool:
    """Map CPU blocks of ``threshold`` bytes or more on their own (default: :func:`configured_threshold`).

    False, and nothing changes, when the threshold is 0, the kernel has no transparent huge pages, or the op
    is unavailable (no compiler, ``SLIPSTREAM_DISABLE_OPS=1``); see [Note: large blocks leave the heap].
    """
    global _installed_threshold, _module
    threshold = configured_threshold() if threshold is None else threshold
    if threshold == 0 or not thp_available() or not glibc_malloc():
        return False
    module = builder.load(LARGE_BLOCKS)
    if module is None:
        return False
    if not (module.installed() and _installed_threshold == threshold):  # each engine asks; install once
        if not module.install(threshold):  # torch's CPU allocator is not its default one: leave it be
            return False
        _installed_threshold, _module = threshold, module
    return True


def trim(everything: bool = False) -> None:
    """Unmap cached freed blocks: those freed before the last trim and not taken since (the engine trims after each
    optimizer step), or all of them (``everything``); see the cache in the source."""
    if _module is not None:
        _module.trim(everything)


@functools.cache
def glibc_malloc() -> bool:
    """Whether glibc's ``malloc`` serves torch's small blocks: the op tells its blocks from those by the word glibc
    keeps before each pointer (``kMagic`` in the source). Not with another ``malloc`` preloaded (jemalloc,
    tcmalloc, mimalloc: they keep freed memory in check on their own) or another C library."""
    if "malloc" in os.environ.get("LD_PRELOAD", ""):
        return False
    return platform.libc_ver()[0] == "glibc"


def installed_mib() -> float:
    """The threshold installed, in MiB (0 when not installed)."""
    return _installed_threshold / 2**20 if installed() else 0.0


def _loaded() -> Any:
    """The op if this process already loaded it (never builds it: asking about it must not compile anything)."""
    return builder.load(LARGE_BLOCKS) if builder.loaded_status(LARGE_BLOCKS) is not None else None


def uninstall() -> None:
    """Put the replaced allocator back; blocks already mapped stay valid and are unmapped when freed."""
    module = _loaded()
    if module is not None:
        module.uninstall()


def installed() -> bool:
    module = _loaded()
    return bool(module is not None and module.installed())


def reset_high_water() -> None:
    """Let the cache hold no more than what is live now: the next new block unmaps cached ones first (tests)."""
    module = _loaded()
    if module is not None:
        module.reset_high_water()


def stats() -> dict[str, int]:
    """``mapped_bytes`` (live large blocks), ``cached_bytes`` (freed, kept for reuse), ``high_water`` (the most live
    bytes so far: live + cached never exceeds it), ``maps`` (mapped so far), ``reused`` (allocations served from the
    cache), ``evicted`` (cached blocks unmapped to stay under the high water), ``live_blocks``; zeros when never
    loaded."""
    module = _loaded()
    if module is None:
        keys = ("mapped_bytes", "cached_bytes", "high_water", "maps", "reused", "evicted", "live_blocks")
        return dict.fromkeys(keys, 0)
    return dict(module.stats())
