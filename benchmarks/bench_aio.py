"""Async I/O throughput: slipstream's aio op vs dd-style sequential I/O on the same path.

    python benchmarks/bench_aio.py [--path /tmp] [--size-mb 1024] [--rounds 3] [--threads 8] [--block-mb 1]

Each round writes then reads a file of --size-mb with (A) ``dd bs=1M oflag=direct`` / ``iflag=direct``
(O_DIRECT, one sequential stream: the device's plain sequential rate), (B) ``AsyncIO`` with
O_DIRECT in --threads parallel blocks, (C) the op's pure-Python fallback (buffered, os.pwritev in
a thread pool), and, when installed (--deepspeed-python), (D) DeepSpeed's aio handle. The file is
fsync'ed after buffered writes and the page cache dropped for it (posix_fadvise DONTNEED) before
reads, so buffered reads come from the disk too. Prints median GB/s and the ratio to dd.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

_DS_SCRIPT = """
import sys, time, torch
from deepspeed.ops.op_builder import AsyncIOBuilder
path, nbytes, block, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
h = AsyncIOBuilder().load().aio_handle(block, 8, False, True, threads)
buf = torch.empty(nbytes, dtype=torch.uint8).pin_memory() if False else h.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
buf.fill_(1)
t = time.perf_counter(); h.async_pwrite(buf, path); h.wait(); os_sync = time.perf_counter() - t
import os; fd = os.open(path, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
t = time.perf_counter(); h.async_pread(buf, path); h.wait(); r = time.perf_counter() - t
print(nbytes / os_sync / 1e9, nbytes / r / 1e9)
"""


def _drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _dd(path: str, size_mb: int) -> tuple[float, float]:
    def run(args: list[str]) -> float:
        done = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
        match = re.search(r"copied, ([0-9.]+) s", done.stderr)
        assert match, done.stderr
        return size_mb * 2**20 / float(match.group(1)) / 1e9

    write = run(["if=/dev/zero", f"of={path}", "bs=1M", f"count={size_mb}", "oflag=direct", "conv=notrunc"])
    _drop_cache(path)
    read = run([f"if={path}", "of=/dev/null", "bs=1M", "iflag=direct"])
    return write, read


def _ours(path: str, size_mb: int, threads: int, block: int, compiled: bool) -> tuple[float, float]:
    import torch

    from slipstream.ops.aio import AsyncIO, aligned_empty

    io = AsyncIO(block_size=block, threads=threads, use_op=compiled)
    buf = aligned_empty(size_mb * 2**20, torch.uint8).fill_(1)
    start = time.perf_counter()
    io.submit_write(buf, path)
    io.wait()
    if not compiled:
        _drop_cache(path)  # buffered: count the flush to disk, as the O_DIRECT paths do
    write = buf.numel() / (time.perf_counter() - start) / 1e9
    _drop_cache(path)
    start = time.perf_counter()
    io.submit_read(buf, path)
    io.wait()
    read = buf.numel() / (time.perf_counter() - start) / 1e9
    return write, read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", default="/tmp")
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--block-mb", type=int, default=1)
    parser.add_argument("--deepspeed-python", default=None)
    args = parser.parse_args()
    from slipstream.ops.aio import aio_available

    assert aio_available(), "the aio op did not build"
    path = os.path.join(args.path, f"slipstream-bench-aio-{os.getpid()}.bin")
    kinds = ["dd (O_DIRECT, 1 stream)", "slipstream aio (O_DIRECT)", "python fallback (buffered)"]
    if args.deepspeed_python:
        kinds.append("deepspeed aio")
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    try:
        for _ in range(args.rounds):
            for kind in kinds:
                if kind.startswith("dd"):
                    results[kind].append(_dd(path, args.size_mb))
                elif kind.startswith("slipstream"):
                    results[kind].append(_ours(path, args.size_mb, args.threads, args.block_mb << 20, True))
                elif kind.startswith("python"):
                    results[kind].append(_ours(path, args.size_mb, args.threads, args.block_mb << 20, False))
                else:
                    out = subprocess.run(
                        [
                            args.deepspeed_python,
                            "-c",
                            _DS_SCRIPT,
                            path,
                            str(args.size_mb << 20),
                            str(args.block_mb << 20),
                            str(args.threads),
                        ],
                        capture_output=True,
                        text=True,
                        check=True,
                        env={**os.environ, "DS_ACCELERATOR": "cpu"},
                    )
                    w, r = map(float, out.stdout.split()[-2:])
                    results[kind].append((w, r))
    finally:
        if os.path.exists(path):
            os.remove(path)
    dd_w = statistics.median(w for w, _ in results[kinds[0]])
    dd_r = statistics.median(r for _, r in results[kinds[0]])
    print(
        f"{args.size_mb} MB file under {args.path}, {args.rounds} alternating rounds, {args.threads} threads x {args.block_mb} MB blocks"
    )
    print(f"{'method':<28} {'write GB/s':>10} {'vs dd':>6} {'read GB/s':>10} {'vs dd':>6}")
    for kind in kinds:
        w = statistics.median(x for x, _ in results[kind])
        r = statistics.median(x for _, x in results[kind])
        print(f"{kind:<28} {w:10.2f} {w / dd_w:6.2f} {r:10.2f} {r / dd_r:6.2f}")


if __name__ == "__main__":
    main()
