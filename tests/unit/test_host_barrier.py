"""The same-host barrier of pipes (``slipstream/comm/host_barrier.py``), both ranks' ends in one process."""

from __future__ import annotations

import datetime
import glob
import threading
import uuid

import pytest

from slipstream.comm import host_barrier
from slipstream.comm.process import PROCESS


@pytest.fixture
def barriers():
    prefix = uuid.uuid4().hex
    incoming = [host_barrier.make_incoming(prefix, rank, 2) for rank in (0, 1)]
    outgoing = [host_barrier.open_outgoing(prefix, rank, 2) for rank in (0, 1)]
    for rank in (0, 1):
        host_barrier.unlink_incoming(prefix, rank, 2)
    assert not glob.glob(f"/dev/shm/slipstream-{prefix}-*")
    made = [host_barrier.HostBarrier(incoming[r], outgoing[r]) for r in (0, 1)]
    saved = PROCESS.timeout
    PROCESS.timeout = datetime.timedelta(seconds=0.5)
    yield made
    PROCESS.timeout = saved
    for barrier in made:
        barrier.close()


def _both_wait(barriers: list[host_barrier.HostBarrier], times: int) -> None:
    other = threading.Thread(target=lambda: [barriers[1].wait() for _ in range(times)])
    other.start()
    for _ in range(times):
        barriers[0].wait()
    other.join()


def test_ranks_meet_again_and_again(barriers) -> None:
    _both_wait(barriers, 200)


def test_a_rank_that_never_arrives_is_named_at_the_timeout(barriers) -> None:
    _both_wait(barriers, 3)
    with pytest.raises(host_barrier.HostBarrierError, match="timed out after 0.5s waiting for rank 1"):
        barriers[0].wait()


def test_a_stopped_rank_frees_its_peer_and_refuses_to_wait(barriers) -> None:
    barriers[1].stop("rank 1: step: ValueError: bad batch")
    with pytest.raises(host_barrier.HostBarrierError, match="rank 1 closed its pipe"):
        barriers[0].wait()
    with pytest.raises(host_barrier.HostBarrierError, match="not entered: rank 1: step: ValueError"):
        barriers[1].wait()
