"""The large-block CPU allocator ([Note: large blocks leave the heap], slipstream/ops/large_blocks.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slipstream.ops import large_blocks

MIB = 2**20

pytestmark = pytest.mark.skipif(
    not large_blocks.thp_available() or not large_blocks.glibc_malloc(),
    reason="the kernel offers no transparent huge pages, or malloc is not glibc's: nothing is installed",
)


@pytest.fixture
def installed() -> None:
    assert large_blocks.install(4 * MIB), "the op did not build or load"
    yield
    large_blocks.trim(everything=True)
    large_blocks.uninstall()  # the rest of the unit suite on glibc, as before it was installed


def test_a_large_block_is_mapped_aligned_cached_when_freed_and_unmapped_by_trim(installed: None) -> None:
    large_blocks.trim(everything=True)
    before = large_blocks.stats()
    block = torch.empty(5 * MIB + MIB // 2, dtype=torch.uint8)
    during = large_blocks.stats()
    assert during["maps"] == before["maps"] + 1 and during["live_blocks"] == before["live_blocks"] + 1
    assert during["mapped_bytes"] - before["mapped_bytes"] == 6 * MIB  # whole huge pages: the class of 5.5 MiB
    assert block.data_ptr() % (2 * MIB) == 0, "the mapping must start on a huge-page boundary"
    block.fill_(3)  # (a sum would make a 40 MiB int64 copy: a large block of its own)
    assert int(block[0]) == int(block[3 * MIB]) == int(block[-1]) == 3
    address = block.data_ptr()
    del block
    freed = large_blocks.stats()
    assert freed["mapped_bytes"] == before["mapped_bytes"] and freed["live_blocks"] == before["live_blocks"]
    assert freed["cached_bytes"] == 6 * MIB, "a freed block waits for the next one of its size"
    again = torch.empty(6 * MIB - 4096, dtype=torch.uint8)  # the same class: served from the cache, not mapped
    assert again.data_ptr() == address and large_blocks.stats()["maps"] == during["maps"]
    assert large_blocks.stats()["reused"] == before["reused"] + 1 and large_blocks.stats()["cached_bytes"] == 0
    del again
    large_blocks.trim()  # freed since the last trim: kept one more step
    assert large_blocks.stats()["cached_bytes"] == 6 * MIB
    large_blocks.trim()  # not taken again for a whole step: unmapped
    assert large_blocks.stats()["cached_bytes"] == 0
    kept = torch.empty(8 * MIB, dtype=torch.uint8)
    del kept
    large_blocks.trim(everything=True)
    assert large_blocks.stats()["cached_bytes"] == 0


def test_the_cache_never_holds_more_than_the_peak_already_paid_for(installed: None) -> None:
    """[Note: the cache holds only what the peak already paid for]: live + cached never exceeds the high water;
    a block that does not fit in the cache's room unmaps the least recently freed ones first."""
    large_blocks.trim(everything=True)
    large_blocks.reset_high_water()  # only what is live now (the tests before may have left blocks alive)
    base = large_blocks.stats()["mapped_bytes"]

    def above_base() -> tuple[int, int, int]:
        stats = large_blocks.stats()
        return stats["mapped_bytes"] - base, stats["cached_bytes"], stats["high_water"] - base

    six, ten = torch.empty(6 * MIB, dtype=torch.uint8), torch.empty(10 * MIB, dtype=torch.uint8)
    assert above_base() == (16 * MIB, 0, 16 * MIB)
    del six, ten  # the six first: the least recently freed
    assert above_base() == (0, 16 * MIB, 16 * MIB), "freeing keeps live + cached at the high water"
    evicted = large_blocks.stats()["evicted"]
    eight = torch.empty(8 * MIB, dtype=torch.uint8)  # no 8 MiB block cached: room for it is made
    live, cached, high = above_base()
    assert live + cached <= high == 16 * MIB, "a new block may not lift live + cached above the high water"
    assert (live, cached) == (8 * MIB, 0) and large_blocks.stats()["evicted"] == evicted + 2, (
        "the 6 MiB block went first (least recently freed), and the 10 MiB one no longer fit beside 8 MiB"
    )
    twelve = torch.empty(12 * MIB, dtype=torch.uint8)  # a new peak: the high water rises with what is live
    assert above_base() == (20 * MIB, 0, 20 * MIB)
    del eight, twelve
    assert above_base() == (0, 20 * MIB, 20 * MIB)
    again = torch.empty(12 * MIB - 4096, dtype=torch.uint8)  # its class is cached: taken, nothing unmapped
    assert above_base() == (12 * MIB, 8 * MIB, 20 * MIB) and large_blocks.stats()["evicted"] == evicted + 2
    del again


def test_a_block_is_rounded_to_whole_huge_pages_only_where_that_wastes_at_most_an_eighth(installed: None) -> None:
    """A touched huge page is resident whole: 3.1 MiB in 4 MiB would keep 29% more than it uses."""
    for nbytes, length in (
        (6 * MIB - 512 * 1024, 6 * MIB),  # 0.5 MiB over 5.5: within an eighth, whole huge pages
        (5 * MIB + 100_000, 5 * MIB + 128 * 1024),  # 0.9 MiB over 5.1: 64 KiB classes
        (40 * MIB + 1, 42 * MIB),  # large blocks: at most 2 MiB over
    ):
        before = large_blocks.stats()["mapped_bytes"]
        block = torch.empty(nbytes, dtype=torch.uint8)
        assert large_blocks.stats()["mapped_bytes"] - before == length, f"{nbytes} bytes"
        assert block.data_ptr() % (2 * MIB) == 0, "its whole huge pages start on a huge-page boundary"
        block.fill_(1)
        assert int(block[-1]) == 1
        del block
    large_blocks.trim(everything=True)


def test_a_block_below_one_huge_page_is_rounded_to_64_kib_not_to_a_huge_page() -> None:
    """Under a threshold below 2 MiB a 1 MiB activation gets 1 MiB and 64 KiB at most, not a huge page."""
    assert large_blocks.install(1 * MIB)
    try:
        before = large_blocks.stats()["mapped_bytes"]
        block = torch.empty(MIB + 100, dtype=torch.uint8)
        assert large_blocks.stats()["mapped_bytes"] - before == MIB + 64 * 1024
        block.fill_(7)
        assert int(block[-1]) == 7
        del block
    finally:
        large_blocks.trim(everything=True)
        large_blocks.uninstall()


def test_small_blocks_stay_with_the_allocator_it_replaced(installed: None) -> None:
    before = large_blocks.stats()["maps"]
    small = [torch.empty(4 * MIB - 64, dtype=torch.uint8), torch.randn(1000), torch.zeros(0)]
    assert large_blocks.stats()["maps"] == before
    del small


def test_training_math_is_unchanged_on_mapped_blocks(installed: None) -> None:
    """A model whose weights, activations and gradients are large blocks trains as on glibc's: same bits."""

    def train() -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 1024))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(1))
        for _ in range(2):
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    def served() -> int:
        stats = large_blocks.stats()
        return stats["maps"] + stats["reused"]

    before = served()
    mapped = train()
    assert served() > before, "the 8 MiB weights and activations should have been large blocks"
    large_blocks.uninstall()
    assert not large_blocks.installed()
    before = served()
    plain = train()
    assert served() == before, "uninstalled, nothing is a large block"
    for a, b in zip(mapped, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_reinstalling_is_idempotent_and_a_new_threshold_applies() -> None:
    def served() -> int:  # large blocks handed out so far, mapped or from the cache
        stats = large_blocks.stats()
        return stats["maps"] + stats["reused"]

    assert large_blocks.install(8 * MIB)
    before = served()
    six = torch.empty(6 * MIB, dtype=torch.uint8)
    assert served() == before, "6 MiB is below an 8 MiB threshold"
    assert large_blocks.install(4 * MIB) and large_blocks.install(4 * MIB) and large_blocks.installed_mib() == 4
    seven = torch.empty(7 * MIB, dtype=torch.uint8)
    assert served() == before + 1
    del six, seven
    large_blocks.trim(everything=True)
    large_blocks.uninstall()


def test_the_environment_variable_is_read_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLIPSTREAM_LARGE_BLOCKS", raising=False)
    assert large_blocks.configured_threshold() == large_blocks.DEFAULT_THRESHOLD, (
        "on by default ([Note: on by default])"
    )
    monkeypatch.setenv("SLIPSTREAM_LARGE_BLOCKS", "0")
    assert large_blocks.configured_threshold() == 0 and large_blocks.install() is False
    monkeypatch.setenv("SLIPSTREAM_LARGE_BLOCKS", str(16 * MIB))
    assert large_blocks.configured_threshold() == 16 * MIB
    for bad, match in (("4MB", "not a number of bytes"), ("100", "below one page")):
        monkeypatch.setenv("SLIPSTREAM_LARGE_BLOCKS", bad)
        with pytest.raises(ValueError, match=f"SLIPSTREAM_LARGE_BLOCKS: .*{match}"):
            large_blocks.configured_threshold()


def test_transparent_huge_pages_are_read_from_the_kernel_setting(tmp_path: Path) -> None:
    setting = tmp_path / "enabled"
    for text, available in (
        ("always [madvise] never", True),
        ("[always] madvise never", True),
        ("always madvise [never]", False),
    ):
        setting.write_text(text + "\n")
        assert large_blocks.thp_available(setting) is available
    assert large_blocks.thp_available(tmp_path / "missing") is False


def test_a_forked_child_allocates_large_blocks_while_the_parent_frees_them(installed: None) -> None:
    """DataLoader workers fork: the cache's lock is held across the fork and released on both sides, so a child
    forked while another thread frees a block into the cache still maps and frees its own."""
    import os
    import threading

    stop = threading.Event()

    def churn() -> None:  # frees into the cache and takes from it, on another thread, across the forks
        while not stop.is_set():
            torch.empty(6 * MIB, dtype=torch.uint8)

    worker = threading.Thread(target=churn)
    worker.start()
    try:
        for _ in range(5):
            pid = os.fork()
            if pid == 0:  # the child: a large block of its own, then out without running the parent's teardown
                block = torch.empty(10 * MIB, dtype=torch.uint8)
                block.fill_(1)
                os._exit(0 if int(block[-1]) == 1 else 1)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
    finally:
        stop.set()
        worker.join()
