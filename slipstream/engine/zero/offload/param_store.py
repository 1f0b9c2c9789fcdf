"""Where ZeRO-3's parameter shard lives: on the device, in CPU memory, or on NVMe one file per unit.

A unit whose shard is off the device gets a ``fetch`` that brings its chunk to the device just
before the unit's all-gather (``ParamUnit.gather``). On NVMe each unit's chunk has its own swap
file; fetching unit k also starts reading the next unit in the direction the pass is going, so
in steady state the read of one unit overlaps the compute of the previous. The optimizer writes
updated parameters back with :meth:`ParamStore.publish`. The persistent unit (small parameters
kept gathered) always stays in memory.
"""

from __future__ import annotations

from typing import Any

import torch

from slipstream.engine.zero.offload.chunks import Chunks
from slipstream.engine.zero.offload.options import OffloadOptions
from slipstream.engine.zero.offload.swap_dir import SwapDir
from slipstream.ops.aio import ALIGNMENT, AsyncIO, aligned_empty


def open_param_store(
    options: OffloadOptions | None, shard: torch.Tensor, units: list[Any], device: torch.device, job_id: str, rank: int
) -> ParamStore:
    """Stage 3's parameter shard placement from ``offload_param`` (a store that moves nothing without it)."""
    mode = options.param if options is not None else "none"
    swap = io = None
    if options is not None and mode == "nvme":
        assert options.param_nvme_path is not None
        swap = SwapDir.open(options.param_nvme_path, job_id, rank, "zero_optimization.offload_param.nvme_path")
        io = AsyncIO(options.aio.block_size, options.aio.threads, options.aio.use_direct)
    pin = options is not None and options.pin_memory and device.type == "cuda"
    return ParamStore(mode, shard, units, device, pin, swap, io)


class ParamStore:
    def __init__(
        self,
        mode: str,
        param_shard: torch.Tensor,
        units: list[Any],
        device: torch.device,
        pin: bool,
        swap: SwapDir | None = None,
        io: AsyncIO | None = None,
    ) -> None:
        """``mode``: "none", "cpu" or "nvme"; ``units``: ParamUnits whose ``shard`` views ``param_shard``
        (``offset``/``chunk``: where their chunk lies in it)."""
        self.mode, self.device, self.swap, self.io = mode, device, swap, io
        self.dtype = param_shard.dtype
        self.units = units
        self.shard = param_shard
        self._initial: Chunks | None = None
        self.swapped = [u for u in units if u.kind != "persistent"] if mode == "nvme" else []
        self.position = {u.index: i for i, u in enumerate(self.swapped)}
        self.reads: dict[int, tuple[torch.Tensor, int]] = {}  # unit -> (buffer, request) read ahead
        self.writes: dict[int, list[int]] = {}  # unit -> write requests not yet known to be done
        self.write_buffers: list[list[tuple[torch.Tensor, int]]] = [[], []]  # last two publishes
        self.last_fetched: int | None = None
        if mode == "cpu" and device.type != "cpu":  # on a CPU device the shard is in CPU memory already
            if pin:
                from slipstream.accelerator import get_accelerator

                self.shard = get_accelerator().pinned_empty(param_shard.numel(), param_shard.dtype).copy_(param_shard)
            else:
                self.shard = param_shard.to("cpu")
            self._rebind(lambda u: self.shard[u.offset : u.offset + u.chunk])
            for u in units:  # the persistent unit too: every all-gather reads from device memory
                u.fetch = self._from_cpu(u)
        elif mode == "nvme":
            assert swap is not None and io is not None
            swap.check_space(sum(self._file_bytes(u) for u in self.swapped))
            self._initial = Chunks([u.offset for u in units], [u.shard for u in units])
            in_flight: list[int] = []  # a few units written at once: bounded memory, the disk kept busy
            for u in self.swapped:
                buffer = self._buffer(u)
                buffer[: u.chunk].copy_(u.shard)
                in_flight.append(self.io.submit_write(buffer, self._file(u)))
                if len(in_flight) > 3:
                    self.io.wait(in_flight.pop(0))
            self.io.wait()
            kept = {u.index: u.shard.clone() for u in units if u.kind == "persistent"}
            self._rebind(
                lambda u: kept[u.index] if u.index in kept else torch.empty(0, dtype=self.dtype, device=device)
            )
            for u in self.swapped:
                u.fetch = self._from_nvme(u)

    def _rebind(self, shard_of: Any) -> None:
        for u in self.units:
            u.shard = shard_of(u)

    def _file(self, unit: Any) -> str:
        assert self.swap is not None
        return self.swap.file(f"param_{unit.index:05d}.swp")

    def _file_bytes(self, unit: Any) -> int:
        nbytes = unit.chunk * self.dtype.itemsize
        return -(-nbytes // ALIGNMENT) * ALIGNMENT

    def _buffer(self, unit: Any) -> torch.Tensor:
        return aligned_empty(self._file_bytes(unit) // self.dtype.itemsize, self.dtype)

    # ------------------------------------------------------------------ what the optimizer sees
    def initial(self) -> Chunks:
        """The starting values of the partition (for the optimizer's fp32 masters)."""
        if self._initial is not None:
            return self._initial
        return Chunks([u.offset for u in self.units], [u.shard for u in self.units])

    def drop_initial(self) -> None:
        """The optimizer has its masters: free the in-memory shard (it lives in the swap files now)."""
        if self._initial is not None:
            self._initial = None
            self.shard.untyped_storage().resize_(0)

    def resident(self) -> Chunks | None:
        """The parameter chunks the optimizer can write in place (None: every update goes through publish)."""
        if self.mode == "nvme":
            return None  # publish writes the swapped units and copies into the persistent one
        return Chunks([u.offset for u in self.units], [u.shard for u in self.units])

    @property
    def publish(self) -> Any:
        return self._publish if self.mode == "nvme" else None

    def _publish(self, k: int, lo: int, values: torch.Tensor) -> None:
        """Updated parameters (model dtype) over ``[lo, lo + len)``: write the swapped units' parts."""
        assert self.io is not None
        previous, current = self.write_buffers
        for _buffer, request in previous:
            self.io.wait(request)
        previous.clear()
        self.write_buffers = [current, previous]
        hi = lo + values.numel()
        for u in self.units:
            begin, end = max(lo, u.offset), min(hi, u.offset + u.chunk)
            if begin >= end:
                continue
            if u.kind == "persistent":
                u.shard[begin - u.offset : end - u.offset].copy_(values[begin - lo : end - lo])
                continue
            whole = begin == u.offset and end == u.offset + u.chunk
            buffer = self._buffer(u) if whole else torch.empty(end - begin, dtype=self.dtype)
            buffer[: end - begin].copy_(values[begin - lo : end - lo])
            request = self.io.submit_write(buffer, self._file(u), (begin - u.offset) * self.dtype.itemsize)
            current.append((buffer, request))
            self.writes.setdefault(u.index, []).append(request)
            self.reads.pop(u.index, None)  # a read-ahead from before this write is stale

    # ------------------------------------------------------------------ fetching for the all-gather
    def _from_cpu(self, unit: Any) -> Any:
        def fetch() -> torch.Tensor:
            return unit.shard.to(self.device, non_blocking=True)

        return fetch

    def _from_nvme(self, unit: Any) -> Any:
        def fetch() -> torch.Tensor:
            buffer = self._read(unit)
            step = 1 if self.last_fetched is None or self.position[unit.index] >= self.last_fetched else -1
            self.last_fetched = self.position[unit.index]
            nxt = self.position[unit.index] + step
            if 0 <= nxt < len(self.swapped) and self.swapped[nxt].index not in self.reads:
                self._start_read(self.swapped[nxt])
            chunk = buffer[: unit.chunk]
            return chunk if self.device.type == "cpu" else chunk.to(self.device)

        return fetch

    def _start_read(self, unit: Any) -> None:
        assert self.io is not None
        for request in self.writes.pop(unit.index, []):
            self.io.wait(request)
        buffer = self._buffer(unit)
        self.reads[unit.index] = (buffer, self.io.submit_read(buffer, self._file(unit)))

    def _read(self, unit: Any) -> torch.Tensor:
        assert self.io is not None
        if unit.index not in self.reads:
            self._start_read(unit)
        buffer, request = self.reads.pop(unit.index)
        self.io.wait(request)
        return buffer

    def read_unit(self, unit: Any) -> torch.Tensor:
        """This rank's chunk of ``unit`` in CPU memory (a copy for swapped units)."""
        if unit.fetch is None or self.mode != "nvme":
            return unit.shard
        return self._read(unit)[: unit.chunk]

    def modified(self, unit: Any, values: torch.Tensor) -> None:
        """GatheredParameters changed ``unit``'s chunk: store it."""
        if self.mode != "nvme" or unit.kind == "persistent":
            unit.shard.copy_(values)
            return
        assert self.io is not None
        buffer = self._buffer(unit)
        buffer[: unit.chunk].copy_(values)
        self.reads.pop(unit.index, None)
        self.writes.setdefault(unit.index, []).append(self.io.submit_write(buffer, self._file(unit)))
        self.io.wait()

    def memory_bytes(self) -> int:
        if self.mode == "nvme":
            return sum(u.shard.numel() * u.shard.element_size() for u in self.units)
        return self.shard.numel() * self.shard.element_size()

    def close(self) -> None:
        if self.io is not None:
            self.io.wait()
        self.reads.clear()
        if self.swap is not None:
            self.swap.remove()
