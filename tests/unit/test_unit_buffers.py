"""ZeRO-3's pool of resident buffers (stage3/buffers.py): views survive the swaps, sizes fit, the pool stays bounded."""

from __future__ import annotations

import pytest
import torch

from slipstream.engine.zero.stage3 import buffers as buffers_module
from slipstream.engine.zero.stage3.buffers import UnitBuffers
from slipstream.engine.zero.storage import alias

pytestmark = pytest.mark.skipif(not buffers_module._CAN_SWAP, reason="this torch has no UntypedStorage._swap_data_ptr_")


def _unit(numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A flat storage emptied as a released unit's is, and a parameter-like view into it."""
    full = torch.empty(numel)
    param = full[2:6]
    full.untyped_storage().resize_(0)
    return full, param


def test_a_refilled_storage_keeps_its_views_and_its_memory_comes_back_to_the_pool() -> None:
    pool = UnitBuffers()
    full, param = _unit(16)
    writer = alias(full.untyped_storage(), 0, (16,), torch.float32)  # what a collective writes through
    pool.fill(full.untyped_storage(), 64)
    writer.copy_(torch.arange(16.0))
    assert param.tolist() == [2.0, 3.0, 4.0, 5.0]  # the view made before the fill sees the new memory
    address = full.untyped_storage().data_ptr()
    pool.empty(full.untyped_storage())
    assert full.untyped_storage().nbytes() == 0 and pool.held_bytes() == 64
    pool.fill(full.untyped_storage(), 64)  # the same memory again: nothing allocated
    assert full.untyped_storage().data_ptr() == address and pool.fresh == 1


def test_a_send_buffer_reuses_what_a_unit_released() -> None:
    pool = UnitBuffers()
    full, _ = _unit(16)
    pool.fill(full.untyped_storage(), 64)
    address = full.untyped_storage().data_ptr()
    pool.empty(full.untyped_storage())
    send = pool.take(16, torch.float32, torch.device("cpu"))
    assert send.data_ptr() == address and send.shape == (16,) and pool.fresh == 1
    pool.give(send)
    assert pool.held_bytes() == 64


def test_a_buffer_serves_a_slightly_smaller_request_but_not_a_much_smaller_one() -> None:
    pool = UnitBuffers()
    big = pool.take(100, torch.uint8, torch.device("cpu"))
    pool.give(big)
    assert pool.take(90, torch.uint8, torch.device("cpu")).untyped_storage().nbytes() == 100  # within a quarter
    assert pool.fresh == 1
    assert pool.take(40, torch.uint8, torch.device("cpu")).untyped_storage().nbytes() == 40  # fresh, not the big one
    assert pool.fresh == 2


def test_the_pool_never_owns_more_than_was_ever_lent_at_once() -> None:
    pool = UnitBuffers()
    sizes = [100, 120, 140, 160]  # every unit its own size, two at a time
    for _step in range(3):
        for first, second in zip(sizes, sizes[1:]):
            a = pool.take(first, torch.uint8, torch.device("cpu"))
            b = pool.take(second, torch.uint8, torch.device("cpu"))
            pool.give(a)
            pool.give(b)
            assert pool.lent == 0 and pool.held_bytes() <= pool.most_lent <= 160 + 160 // 4 + 140
    held = pool.held_bytes()
    pool.shrink()  # after gathering everything at once: nothing kept, the high-water mark forgotten
    assert pool.held_bytes() == 0 and pool.most_lent == 0 and held > 0
