"""The async I/O op and its Python fallback: data round-trips, alignment, partial blocks, errors."""

from __future__ import annotations

import os

import pytest
import torch

from slipstream.ops.aio import ALIGNMENT, AsyncIO, aio_available, aligned_empty

PATHS = ["compiled", "fallback"]


def _handle(kind: str, **kwargs: object) -> AsyncIO:
    if kind == "compiled" and not aio_available():
        pytest.fail("the aio op did not build on this machine (see the op build warning)")
    io = AsyncIO(use_op=kind == "compiled", **kwargs)  # type: ignore[arg-type]
    assert io.compiled == (kind == "compiled")
    return io


def test_aligned_empty_is_aligned() -> None:
    for numel, dtype in [(1, torch.uint8), (12345, torch.float32), (4096, torch.bfloat16)]:
        t = aligned_empty(numel, dtype)
        assert t.data_ptr() % ALIGNMENT == 0 and t.numel() == numel and t.dtype == dtype and t.is_contiguous()


@pytest.mark.parametrize("kind", PATHS)
def test_round_trip_many_blocks_and_offsets(kind: str, tmp_path: os.PathLike[str]) -> None:
    io = _handle(kind, block_size=64 * 1024, threads=4)
    path = os.path.join(tmp_path, "swap.bin")
    first = aligned_empty(300_000, torch.float32).copy_(torch.randn(300_000))  # not a multiple of the block
    second = aligned_empty(4096, torch.bfloat16).copy_(torch.randn(4096))
    offset = first.numel() * 4 + ALIGNMENT - (first.numel() * 4) % ALIGNMENT
    a = io.submit_write(first, path)
    b = io.submit_write(second, path, offset)
    assert io.pending() <= 2
    io.wait(a)
    io.wait(b)
    back1, back2 = aligned_empty(300_000, torch.float32), aligned_empty(4096, torch.bfloat16)
    io.submit_read(back2, path, offset)
    io.submit_read(back1, path)
    io.wait()
    assert torch.equal(back1, first) and torch.equal(back2, second)
    assert os.path.getsize(path) == offset + second.numel() * 2


@pytest.mark.parametrize("kind", PATHS)
def test_unaligned_buffers_and_offsets_are_served_buffered(kind: str, tmp_path: os.PathLike[str]) -> None:
    io = _handle(kind, block_size=4096, threads=2)
    path = os.path.join(tmp_path, "odd.bin")
    data = torch.arange(1001, dtype=torch.int16)[1:]  # storage offset: an unaligned data pointer
    io.submit_write(data, path, 7)
    io.wait()
    back = torch.empty(1000, dtype=torch.int16)
    io.submit_read(back, path, 7)
    io.wait()
    assert torch.equal(back, data)


@pytest.mark.parametrize("kind", PATHS)
def test_errors_name_the_file(kind: str, tmp_path: os.PathLike[str]) -> None:
    io = _handle(kind)
    missing_dir = os.path.join(tmp_path, "no", "such", "dir", "f.bin")
    with pytest.raises(OSError, match="f.bin"):
        io.submit_write(torch.zeros(10), missing_dir)
    path = os.path.join(tmp_path, "short.bin")
    io.submit_write(torch.zeros(10), path)
    io.wait()
    io.submit_read(torch.empty(20), path)  # the file holds 40 bytes, the read asks for 80
    with pytest.raises(OSError, match="short read"):
        io.wait()
    io.submit_read(torch.empty(10), path)  # the handle is usable after a failure
    io.wait()
    with pytest.raises(ValueError, match="contiguous"):
        io.submit_read(torch.empty(4, 4).t(), path)


def test_direct_io_falls_back_with_a_warning_where_unsupported(capsys: pytest.CaptureFixture[str]) -> None:
    probe = f"/dev/shm/slipstream-aio-probe-{os.getpid()}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
        os.remove(probe)
        pytest.skip("tmpfs accepts O_DIRECT on this kernel (6.6+): no filesystem here refuses it")
    except OSError:
        pass
    io = _handle("compiled")
    path = f"/dev/shm/slipstream-aio-test-{os.getpid()}.bin"
    try:
        data = aligned_empty(ALIGNMENT, torch.uint8).fill_(7)
        io.submit_write(data, path)
        io.wait()
        back = aligned_empty(ALIGNMENT, torch.uint8)
        io.submit_read(back, path)
        io.wait()
        assert torch.equal(back, data)
        assert "buffered I/O under /dev/shm" in capsys.readouterr().err
    finally:
        os.remove(path)
