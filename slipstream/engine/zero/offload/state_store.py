"""Where the fp32 master partition and the Adam moments live: CPU memory, or NVMe in sub-groups.

Both stores cut the partition into sub-groups ``[lo, hi)`` and hand the optimizer, one sub-group
at a time, :class:`Chunks` views of ``master``, ``exp_avg`` and ``exp_avg_sq`` over it.

[Note: NVMe pipeline] The NVMe store keeps one swap file per sub-group (master, exp_avg,
exp_avg_sq back to back, each padded to 4 KiB so every transfer can use O_DIRECT) and three
buffers. While sub-group k is stepped, k+1 is being read and k-1 written back; a buffer is
reused only after its write completed, and the last writes of a step finish while the next
forward runs. Memory: 3 x 3 x sub_group fp32 elements, whatever the model size.
"""

from __future__ import annotations

import abc

import torch

from slipstream.accelerator import get_accelerator
from slipstream.engine.zero.offload.chunks import Chunks, copy_out
from slipstream.engine.zero.offload.swap_dir import SwapDir
from slipstream.ops.aio import ALIGNMENT, AsyncIO, aligned_empty

STATE_NAMES = ("master", "exp_avg", "exp_avg_sq")
_ALIGN_NUMEL = ALIGNMENT // 4  # fp32 elements per 4 KiB


def split(numel: int, boundaries: list[int], limit: int) -> list[tuple[int, int]]:
    """Sub-groups of ``[0, numel)``: consecutive ``boundaries`` (sorted starts of buckets) packed up
    to ``limit`` elements, a bucket larger than ``limit`` cut at multiples of 4 KiB."""
    limit = max(_ALIGN_NUMEL, limit // _ALIGN_NUMEL * _ALIGN_NUMEL)
    edges = [b for b in boundaries if 0 < b < numel] + [numel]
    groups: list[tuple[int, int]] = []
    lo, last = 0, 0
    for edge in edges:
        if edge - lo > limit and last > lo:  # close the group before this bucket overflows it
            groups.append((lo, last))
            lo = last
        while edge - lo > limit:
            groups.append((lo, lo + limit))
            lo += limit
        last = edge
    if lo < numel:
        groups.append((lo, numel))
    return groups


class StateStore(abc.ABC):
    subgroups: list[tuple[int, int]]
    pinned: bool = False

    @abc.abstractmethod
    def acquire(self, k: int) -> dict[str, Chunks]:
        """Views of the three tensors over sub-group ``k`` (blocks until they are in memory)."""

    def release(self, k: int) -> None:
        """Sub-group ``k`` was updated: persist it (asynchronously)."""

    def after_release(self, k: int, request: int) -> None:
        """Tie an I/O request that reads from sub-group ``k``'s buffer to that buffer's reuse."""

    def flush(self) -> None:
        """Wait for every outstanding write."""

    def read(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """A copy of ``name`` over ``[lo, hi)`` (for checkpoints and consolidation)."""
        out = torch.empty(hi - lo, dtype=torch.float32)
        for k, (a, b) in enumerate(self.subgroups):
            if a < hi and lo < b:
                view = self.acquire(k)[name]
                begin, end = max(a, lo), min(b, hi)
                copy_out(view, out[begin - lo : end - lo], begin)
        return out

    def write(self, name: str, lo: int, values: torch.Tensor) -> None:
        """Overwrite ``name`` over ``[lo, lo + len(values))`` (checkpoint loading)."""
        from slipstream.engine.zero.offload.chunks import copy_in

        hi = lo + values.numel()
        for k, (a, b) in enumerate(self.subgroups):
            if a < hi and lo < b:
                copy_in(self.acquire(k)[name], values[max(a, lo) - lo : min(b, hi) - lo], max(a, lo))
                self.release(k)
        self.flush()

    def view(self, name: str, lo: int, numel: int) -> torch.Tensor | None:
        """A writable in-memory view of ``name`` over ``[lo, lo + numel)`` inside one chunk; None when swapped."""
        return None

    def memory_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass


class CPUStateStore(StateStore):
    """Everything in (pinned, when the device is CUDA) CPU memory; one sub-group, no copies.

    ``master`` may alias the parameters themselves (fp32 model on a CPU device): then the optimizer
    updates the model's storage in place, exactly as without offload.
    """

    def __init__(self, numel: int, master: Chunks | None, initial: Chunks | None, pin: bool) -> None:
        def zeros() -> torch.Tensor:
            if not pin:
                return torch.zeros(numel, dtype=torch.float32)
            return get_accelerator().pinned_empty(numel, torch.float32).zero_()

        self.pinned = pin
        self.subgroups = [(0, numel)]
        self.owned: list[torch.Tensor] = []
        if master is None:
            flat = zeros()
            if initial is not None:
                copy_out(initial, flat, 0)
            self.owned.append(flat)
            master = Chunks.flat(flat)
        self.views = {"master": master, "exp_avg": Chunks.flat(zeros()), "exp_avg_sq": Chunks.flat(zeros())}
        self.owned += [self.views["exp_avg"].tensors[0], self.views["exp_avg_sq"].tensors[0]]

    def acquire(self, k: int) -> dict[str, Chunks]:
        return self.views

    def view(self, name: str, lo: int, numel: int) -> torch.Tensor | None:
        return self.views[name].slice(lo, numel)

    def memory_bytes(self) -> int:
        return sum(t.numel() * 4 for t in self.owned)


class NVMeStateStore(StateStore):
    """One swap file per sub-group, three buffers, read-ahead and write-behind (see the note above)."""

    def __init__(
        self,
        numel: int,
        subgroups: list[tuple[int, int]],
        initial: Chunks,
        swap: SwapDir,
        io: AsyncIO,
        pin: bool,
        buffers: int = 3,
    ) -> None:
        self.subgroups, self.swap, self.io, self.pinned = subgroups, swap, io, pin
        self.capacity = -(-max(hi - lo for lo, hi in subgroups) // _ALIGN_NUMEL) * _ALIGN_NUMEL
        swap.check_space(len(subgroups) * 3 * self.capacity * 4)
        count = min(buffers, len(subgroups))
        self.buffers = [aligned_empty(3 * self.capacity, torch.float32, pin=pin) for _ in range(count)]
        self.holder: list[int | None] = [None] * count  # sub-group whose data a buffer holds (or is reading)
        self.reads: dict[int, int] = {}  # buffer -> read request in flight
        self.writes: dict[int, list[int]] = {}  # buffer -> requests that still read from it
        self.files = [swap.file(f"optimizer_{k:05d}.swp") for k in range(len(subgroups))]
        self.dirty: set[int] = set()  # buffers changed by write() and not yet written back
        self._initialize(initial)

    def _size(self, k: int) -> int:
        lo, hi = self.subgroups[k]
        return -(-(hi - lo) // _ALIGN_NUMEL) * _ALIGN_NUMEL

    def _initialize(self, initial: Chunks) -> None:
        for k, (lo, _) in enumerate(self.subgroups):
            b = k % len(self.buffers)
            self._drain(b)
            buffer = self.buffers[b][: 3 * self.capacity]
            buffer.zero_()
            copy_out(initial, buffer[: self.subgroups[k][1] - lo], lo)
            self.holder[b] = k
            self._write(b, k)
        self.flush()

    def _views(self, b: int, k: int) -> dict[str, Chunks]:
        lo, hi = self.subgroups[k]
        base = self.buffers[b]
        return {
            name: Chunks.flat(base[i * self.capacity : i * self.capacity + hi - lo], lo)
            for i, name in enumerate(STATE_NAMES)
        }

    def _region(self, b: int, k: int) -> list[torch.Tensor]:
        size = self._size(k)
        return [self.buffers[b][i * self.capacity : i * self.capacity + size] for i in range(3)]

    def _write(self, b: int, k: int) -> None:
        size = self._size(k)
        self.writes.setdefault(b, []).extend(
            self.io.submit_write(region, self.files[k], i * size * 4) for i, region in enumerate(self._region(b, k))
        )

    def _read(self, b: int, k: int) -> None:
        size = self._size(k)
        self._write_back(b)
        self._drain(b)
        self.holder[b] = k
        requests = [
            self.io.submit_read(region, self.files[k], i * size * 4) for i, region in enumerate(self._region(b, k))
        ]
        self.reads[b] = requests[-1]
        self.writes.setdefault(b, []).extend(requests[:-1])  # waited with the buffer's next reuse

    def _drain(self, b: int) -> None:
        """Finish every transfer touching buffer ``b``."""
        for request in self.writes.pop(b, []):
            self.io.wait(request)
        if b in self.reads:
            self.io.wait(self.reads.pop(b))

    def acquire(self, k: int) -> dict[str, Chunks]:
        b = k % len(self.buffers)
        if self.holder[b] != k:
            self._read(b, k)
        self._drain(b)  # the read (and the two before it) complete
        nxt = k + 1
        if nxt < len(self.subgroups) and len(self.buffers) > 1:
            nb = nxt % len(self.buffers)
            if self.holder[nb] != nxt:
                self._read(nb, nxt)
        return self._views(b, k)

    def release(self, k: int) -> None:
        self.dirty.discard(k % len(self.buffers))
        self._write(k % len(self.buffers), k)

    def write(self, name: str, lo: int, values: torch.Tensor) -> None:
        """Like StateStore.write, but a sub-group is written back once, when its buffer is reused
        or at :meth:`flush`, not once per call: loading a checkpoint writes piece by piece."""
        from slipstream.engine.zero.offload.chunks import copy_in

        hi = lo + values.numel()
        for k, (a, b) in enumerate(self.subgroups):
            if a < hi and lo < b:
                copy_in(self.acquire(k)[name], values[max(a, lo) - lo : min(b, hi) - lo], max(a, lo))
                self.dirty.add(k % len(self.buffers))

    def _write_back(self, b: int) -> None:
        holder = self.holder[b]
        if b in self.dirty and holder is not None:
            self.dirty.discard(b)
            self._write(b, holder)

    def after_release(self, k: int, request: int) -> None:
        self.writes.setdefault(k % len(self.buffers), []).append(request)

    def flush(self) -> None:
        for b in range(len(self.buffers)):
            self._write_back(b)
            self._drain(b)

    def prefetch_first(self) -> None:
        """Start reading sub-group 0 (call when the step is near: the first read then overlaps)."""
        if self.holder[0] != 0:
            self._read(0, 0)

    def memory_bytes(self) -> int:
        return sum(b.numel() * 4 for b in self.buffers)

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self.swap.remove()
