"""Offload building blocks without ranks: sub-group splitting, partition chunks, the NVMe state store."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from slipstream.engine.zero.offload.chunks import Chunks, copy_in, copy_out
from slipstream.engine.zero.offload.state_store import STATE_NAMES, CPUStateStore, NVMeStateStore, split
from slipstream.engine.zero.offload.swap_dir import SwapDir
from slipstream.ops.aio import AsyncIO


def test_split_packs_buckets_and_cuts_large_ones_at_4k_multiples() -> None:
    assert split(10_000, [0, 3000, 6000], 8192) == [(0, 6000), (6000, 10_000)]
    assert split(10_000, [0], 4096) == [(0, 4096), (4096, 8192), (8192, 10_000)]
    assert split(100, [0, 50], 10**9) == [(0, 100)]
    groups = split(50_000, [0, 1000, 30_000, 31_000], 9000)
    assert groups[0][0] == 0 and groups[-1][1] == 50_000
    assert all(a[1] == b[0] for a, b in itertools.pairwise(groups)) and all(hi - lo <= 9000 for lo, hi in groups)


def test_chunks_address_partition_coordinates() -> None:
    a, b = torch.arange(10.0), torch.arange(100.0, 105.0)
    chunks = Chunks([10, 0], [b, a])  # any order
    assert torch.equal(chunks.slice(3, 4), a[3:7]) and torch.equal(chunks.slice(11, 2), b[1:3])
    with pytest.raises(IndexError, match="crosses"):
        chunks.slice(8, 4)
    out = torch.full((15,), -1.0)
    copy_out(chunks, out, 0)
    assert torch.equal(out, torch.cat([a, b]))
    copy_in(chunks, torch.zeros(4), 8)  # spans both chunks
    assert a[8:].eq(0).all() and b[:2].eq(0).all() and b[2] == 102


def test_cpu_store_aliases_given_masters() -> None:
    params = torch.randn(100)
    store = CPUStateStore(100, Chunks.flat(params), None, pin=False)
    assert store.acquire(0)["master"].tensors[0] is params
    assert store.memory_bytes() == 2 * 100 * 4  # the moments only


def test_nvme_store_round_trips_with_read_ahead_and_write_behind(tmp_path: os.PathLike[str]) -> None:
    numel = 10_000
    initial = torch.randint(-1000, 1000, (numel,)).float()  # exact under +1
    swap = SwapDir.open(str(tmp_path), "job", 0, "zero_optimization.offload_optimizer.nvme_path")
    store = NVMeStateStore(
        numel, split(numel, [0], 2048), Chunks.flat(initial), swap, AsyncIO(block_size=4096), pin=False
    )
    assert len(store.subgroups) == 5 and len(store.buffers) == 3 and len(os.listdir(swap.path)) == 5 + 1  # + owner
    assert torch.equal(store.read("master", 0, numel), initial)
    assert store.read("exp_avg", 0, numel).eq(0).all()
    for _ in range(2):  # a "step": every sub-group acquired, changed, released in order
        for k in range(len(store.subgroups)):
            views = store.acquire(k)
            for name in STATE_NAMES:
                views[name].tensors[0].add_(1.0)
            store.release(k)
    for name, base in zip(STATE_NAMES, (initial, torch.zeros(numel), torch.zeros(numel))):
        torch.testing.assert_close(store.read(name, 0, numel), base + 2.0, rtol=0, atol=0)
    values = torch.randn(3000)
    store.write("exp_avg_sq", 1500, values)
    assert torch.equal(store.read("exp_avg_sq", 1500, 4500), values)
    store.close()
    assert not os.path.exists(swap.path)
