"""Same-host shared memory under the ring's all-gather, reduce-scatter and all-reduce (``slipstream/comm/shm.py``).

The shared path must give what the socket ring gives (the gather bit for bit, the sum in rank
order), over many pieces so the two halves alternate, and the set-up must be all-or-nothing: one
rank that cannot map the files keeps the whole group on sockets, and no file is left behind. The
ranks meet at a barrier of pipes (``host_barrier.py``): a rank that never arrives is named when the
timeout passes, and one that aborts frees its peers at once.
"""

from __future__ import annotations

import datetime
import glob
import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

from slipstream import comm
from slipstream.comm import ring_collectives, shm
from slipstream.comm.process import PROCESS
from tests.harness import run_distributed

LEFT_BEHIND = os.path.join(shm.SHM_DIR, "slipstream-*")


@contextmanager
def _fresh_ring() -> Iterator[ring_collectives.RingContext]:
    """A ring (and its shared memory, if any) set up now on a new group of every rank, removed afterwards."""
    group = dist.new_group(ranks=list(range(dist.get_world_size())))
    context = ring_collectives.ring_context(group)
    assert context is not None
    try:
        yield context
    finally:
        context.close()
        del PROCESS.rings[id(group)]
        dist.destroy_process_group(context.group)
        dist.destroy_process_group(group)


def _collectives(
    context: ring_collectives.RingContext, numel: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's reduce-scatter chunk and all-gather result, data drawn the same on every rank."""
    world, rank = context.size, context.rank
    data = torch.randn(world, numel * world, generator=torch.Generator().manual_seed(5)).to(dtype)
    reduced = data[rank].clone()
    comm.reduce_scatter_tensor(reduced.view(world, -1)[rank], reduced, group=context.parent).wait()
    gathered = torch.zeros(numel * world, dtype=dtype)
    comm.all_gather_into_tensor(gathered, data[rank].view(world, -1)[rank].clone(), group=context.parent).wait()
    return reduced.view(world, -1)[rank].clone(), gathered


def _match_body(piece_bytes: int) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    numel = 10_007  # odd: the last piece is short
    saved = shm.PIECE_BYTES
    shm.PIECE_BYTES = piece_bytes  # many pieces: the halves alternate dozens of times per call
    try:
        with _fresh_ring() as context:
            assert context.shared is not None, "ranks of one host should share memory"
            for dtype in (torch.float32, torch.bfloat16):
                reduced, gathered = _collectives(context, numel, dtype)
                data = torch.randn(world, numel * world, generator=torch.Generator().manual_seed(5)).to(dtype)
                in_rank_order = data[0].clone()
                for peer in range(1, world):
                    in_rank_order += data[peer]
                assert torch.equal(reduced, in_rank_order.view(world, -1)[rank]), dtype
                assert torch.equal(gathered, torch.cat([data[p].view(world, -1)[p] for p in range(world)])), dtype
            reduced, gathered = _collectives(context, 0, torch.float32)  # empty: no piece, no barrier, on every rank
            assert reduced.numel() == gathered.numel() == 0
            _check_all_reduce(context, numel)
    finally:
        shm.PIECE_BYTES = saved
    assert not glob.glob(LEFT_BEHIND)


def _check_all_reduce(context: ring_collectives.RingContext, numel: int) -> None:
    """Sum, max and min through shared memory: each rank's result is the fold in rank order, bit for bit, on every
    rank (so replicated parameters stay identical), for floats, bf16 and integers, over many pieces."""
    world, rank = context.size, context.rank
    folds = {dist.ReduceOp.SUM: lambda a, b: a + b, dist.ReduceOp.MAX: torch.maximum, dist.ReduceOp.MIN: torch.minimum}
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        data = (torch.randn(world, numel, generator=torch.Generator().manual_seed(7)) * 100).to(dtype)
        for op, fold in folds.items():
            tensor = data[rank].clone()
            records = len(PROCESS.log.records)
            comm.all_reduce(tensor, op=op, group=context.parent, tag="probe").wait()
            expected = data[0].clone()
            for peer in range(1, world):
                expected = fold(expected, data[peer])
            assert torch.equal(tensor, expected), (dtype, op)
            assert [r.op for r in PROCESS.log.records[records:]] == ["all_reduce"]
            assert torch.equal(comm.all_gather_objects(tensor, group=context.parent)[0], tensor)


@pytest.mark.parametrize("world", [2, 4])
def test_shared_memory_gives_the_gather_exactly_and_the_sum_in_rank_order(world: int) -> None:
    run_distributed(world, _match_body, 4096)


def _refused_body(how: str) -> None:
    rank = dist.get_rank()
    saved_env, saved_open = os.environ.get(shm.ENV_SWITCH), shm._open
    if rank == 1 and how == "switched off":
        os.environ[shm.ENV_SWITCH] = "0"
    if rank == 1 and how == "cannot open a peer's file":
        shm._open = lambda path: None
    try:
        with _fresh_ring() as context:
            assert context.shared is None, f"rank {rank} shares memory although rank 1 could not"
            reduced, gathered = _collectives(context, 1000, torch.float32)
    finally:
        shm._open = saved_open
        if saved_env is None:
            os.environ.pop(shm.ENV_SWITCH, None)
        else:
            os.environ[shm.ENV_SWITCH] = saved_env
    world = dist.get_world_size()
    data = torch.randn(world, 1000 * world, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(reduced, data.sum(0).view(world, -1)[rank])
    assert torch.equal(gathered, torch.cat([data[p].view(world, -1)[p] for p in range(world)]))
    assert not glob.glob(LEFT_BEHIND), "a refused set-up left its files in /dev/shm"
    with _fresh_ring() as context:
        assert context.shared is not None, "the refusal outlived its cause"


@pytest.mark.parametrize("how", ["switched off", "cannot open a peer's file"])
def test_one_rank_that_cannot_share_memory_keeps_the_group_on_sockets(how: str) -> None:
    run_distributed(2, _refused_body, how)


def _absent_peer_body(how: str) -> str:
    rank = dist.get_rank()
    saved = PROCESS.timeout
    PROCESS.timeout = datetime.timedelta(seconds=3 if how == "never arrives" else 120)
    try:
        with _fresh_ring() as context:
            assert context.shared is not None
            if rank == 1:
                if how == "aborts":
                    context.abort("rank 1: step: ValueError: bad batch")
                dist.barrier()  # after rank 0 has failed (the default group: its timeout is not the 3 s)
                return "absent"
            with pytest.raises(comm.CollectiveError) as info:
                comm.all_reduce(torch.ones(8), group=context.parent, tag="probe").wait()
            dist.barrier()
            return str(info.value)
    finally:
        PROCESS.timeout = saved


@pytest.mark.parametrize("how", ["never arrives", "aborts"])
def test_a_peer_absent_from_the_shared_memory_barrier_is_named(how: str) -> None:
    message = run_distributed(2, _absent_peer_body, how)[0]
    assert "rank 0/2: all_reduce of probe" in message, message
    if how == "never arrives":
        assert "timed out after 3.0s" in message and "rank 1 did not answer" in message, message
    else:  # at once, not after the 120 s timeout (the harness's own limit would fail the test first)
        assert "rank 1 closed its pipe" in message, message
