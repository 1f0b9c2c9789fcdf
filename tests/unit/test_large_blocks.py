"""The large-block CPU allocator ([Note: large blocks leave the heap], slipstream/ops/large_blocks.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slipstream.ops import large_blocks

MIB = 2**20

pytestmark = pytest.mark.skipif(
    not large_blocks.thp_available() or large_blocks.configured_threshold() == 0,
    reason="the kernel offers no transparent huge pages (or SLIPSTREAM_LARGE_BLOCKS=0): nothing is installed",
)


@pytest.fixture
def installed() -> None:
    assert large_blocks.install(4 * MIB), "the op did not build or load"
    yield
    large_blocks.install()  # as the engine leaves it (the default threshold)


def test_a_large_block_is_mapped_aligned_and_unmapped_when_freed(installed: None) -> None:
    before = large_blocks.stats()
    block = torch.empty(5 * MIB, dtype=torch.uint8)
    during = large_blocks.stats()
    assert during["maps"] == before["maps"] + 1 and during["live_blocks"] == before["live_blocks"] + 1
    assert during["mapped_bytes"] - before["mapped_bytes"] == 5 * MIB  # whole pages, nothing rounded to 2 MiB
    assert block.data_ptr() % (2 * MIB) == 0, "the mapping must start on a huge-page boundary"
    block.fill_(3)
    assert int(block[-1]) == 3 and int(block.sum()) == 3 * 5 * MIB
    del block
    after = large_blocks.stats()
    assert after["mapped_bytes"] == before["mapped_bytes"] and after["live_blocks"] == before["live_blocks"]


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

    maps = large_blocks.stats()["maps"]
    mapped = train()
    assert large_blocks.stats()["maps"] > maps, "the 8 MiB weights and activations should have been mapped"
    large_blocks.uninstall()
    assert not large_blocks.installed()
    maps = large_blocks.stats()["maps"]
    plain = train()
    assert large_blocks.stats()["maps"] == maps, "uninstalled, nothing is mapped"
    for a, b in zip(mapped, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_reinstalling_is_idempotent_and_a_new_threshold_applies() -> None:
    assert large_blocks.install(8 * MIB)
    maps = large_blocks.stats()["maps"]
    six = torch.empty(6 * MIB, dtype=torch.uint8)
    assert large_blocks.stats()["maps"] == maps, "6 MiB is below an 8 MiB threshold"
    assert large_blocks.install(4 * MIB) and large_blocks.install(4 * MIB) and large_blocks.installed_mib() == 4
    seven = torch.empty(7 * MIB, dtype=torch.uint8)
    assert large_blocks.stats()["maps"] == maps + 1
    del six, seven
    large_blocks.install()


def test_the_environment_variable_is_read_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
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
