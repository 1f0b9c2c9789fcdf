"""Asynchronous file I/O for NVMe offload: ``AsyncIO.submit_read/submit_write/wait``.

The compiled op (``csrc/aio``) runs a pool of threads doing ``pread``/``pwrite`` in
``block_size`` pieces, with ``O_DIRECT`` (no page cache: swap traffic would otherwise evict
everything else and double the memory it costs) when the buffer, length and file offset are
4 KiB aligned and the filesystem supports it. Without the op (no compiler, failed build,
``SLIPSTREAM_DISABLE_OPS=1``) the same interface runs ``os.preadv``/``os.pwritev`` in a thread
pool: buffered, otherwise equal. Use :func:`aligned_empty` for buffers that qualify for O_DIRECT.

Buffers must stay untouched between submit and wait; the handle keeps them alive until then.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from typing import Any

import torch

from slipstream.ops import builder
from slipstream.ops.specs import AIO
from slipstream.utils.logging import get_logger

__all__ = ["ALIGNMENT", "AsyncIO", "aio_available", "aligned_empty"]

logger = get_logger(__name__)

ALIGNMENT = 4096  # bytes: O_DIRECT's buffer, length and offset granularity on every common filesystem
_warned_paths: set[str] = set()


def aio_available() -> bool:
    """True when the compiled async I/O op is loaded (building or fetching it from the cache)."""
    return builder.load(AIO) is not None


def aligned_empty(numel: int, dtype: torch.dtype = torch.uint8, pin: bool = False) -> torch.Tensor:
    """An uninitialized 1-D CPU tensor whose data starts on a 4 KiB boundary (O_DIRECT-ready).

    ``pin=True`` asks the accelerator for page-locked memory (on CUDA; plain memory on CPU);
    an allocation that is not aligned is replaced by an over-allocation sliced at the first
    aligned byte.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    if pin:
        from slipstream.accelerator import get_accelerator

        pinned = get_accelerator().pinned_empty(numel, dtype)
        if pinned.data_ptr() % ALIGNMENT == 0:
            return pinned
    raw = torch.empty(numel * itemsize + ALIGNMENT, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % ALIGNMENT
    return raw[skip : skip + numel * itemsize].view(dtype)


class AsyncIO:
    """A handle for asynchronous reads and writes between CPU tensors and files.

    ``submit_*`` returns a request id at once; :meth:`wait` blocks until one request (or all)
    completed and raises :class:`OSError` naming the file for any that failed. Files are created
    by writes (not truncated); a read past the end of a file is an error.
    """

    def __init__(
        self, block_size: int = 1 << 20, threads: int = 8, use_direct: bool = True, use_op: bool = True
    ) -> None:
        if block_size <= 0 or threads <= 0:
            raise ValueError(f"AsyncIO: block_size and threads must be positive, got {block_size}, {threads}")
        self.block_size, self.threads = block_size, threads
        op = builder.load(AIO) if use_op else None
        self._handle: Any = op.Handle(block_size, threads, use_direct) if op is not None else None
        self._fallback = None if self._handle is not None else _ThreadPoolIO(block_size, threads)

    @property
    def compiled(self) -> bool:
        return self._handle is not None

    def submit_read(self, tensor: torch.Tensor, path: str | os.PathLike[str], offset: int = 0) -> int:
        """Fill ``tensor`` (contiguous, CPU) from ``path`` starting at byte ``offset``."""
        return self._submit(tensor, path, offset, write=False)

    def submit_write(self, tensor: torch.Tensor, path: str | os.PathLike[str], offset: int = 0) -> int:
        """Write ``tensor``'s bytes to ``path`` at byte ``offset`` (the file is created if missing)."""
        return self._submit(tensor, path, offset, write=True)

    def wait(self, request: int | None = None) -> None:
        """Block until ``request`` (every outstanding request when None) is done; OSError on failure."""
        if self._handle is not None:
            errors = self._handle.wait(-1 if request is None else request)
            self._warn_direct_fallbacks()
        else:
            assert self._fallback is not None
            errors = self._fallback.wait(request)
        if errors:
            raise OSError(f"async I/O failed: {'; '.join(errors)}")

    def pending(self) -> int:
        """Requests submitted and not finished yet."""
        return self._handle.pending() if self._handle is not None else self._fallback.pending()  # type: ignore[union-attr]

    def _submit(self, tensor: torch.Tensor, path: str | os.PathLike[str], offset: int, write: bool) -> int:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(
                f"AsyncIO: buffers must be contiguous CPU tensors, got {tensor.device}, contiguous={tensor.is_contiguous()}"
            )
        if offset < 0:
            raise ValueError(f"AsyncIO: offset must be >= 0, got {offset}")
        path = os.fspath(path)
        if self._handle is not None:
            try:
                return int(self._handle.submit(tensor, path, offset, write))
            except RuntimeError as err:
                raise OSError(str(err).splitlines()[0]) from None
        assert self._fallback is not None
        return self._fallback.submit(tensor, path, offset, write)

    def _warn_direct_fallbacks(self) -> None:
        for message in self._handle.direct_fallbacks():
            directory = os.path.dirname(message.split(":", 1)[0])
            if directory not in _warned_paths:
                _warned_paths.add(directory)
                logger.warning("aio: buffered I/O under %s (%s)", directory, message.split(": ", 1)[-1])


class _ThreadPoolIO:
    """The pure-Python path: ``os.preadv``/``os.pwritev`` per block in a thread pool (buffered I/O)."""

    def __init__(self, block_size: int, threads: int) -> None:
        self.block_size = block_size
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="slipstream-aio")
        self.requests: dict[int, tuple[torch.Tensor, list[concurrent.futures.Future[None]], int]] = {}
        self.next_id = 0
        self.lock = threading.Lock()

    def submit(self, tensor: torch.Tensor, path: str, offset: int, write: bool) -> int:
        flags = (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
        fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0), 0o644)  # OSError names the path
        view = memoryview(tensor.view(torch.uint8).numpy()) if tensor.numel() else memoryview(b"")
        futures = [
            self.pool.submit(_transfer, fd, view[start : start + self.block_size], offset + start, write, path)
            for start in range(0, len(view), self.block_size)
        ]
        with self.lock:
            request = self.next_id
            self.next_id += 1
            self.requests[request] = (tensor, futures, fd)
        return request

    def wait(self, request: int | None) -> list[str]:
        with self.lock:
            keys = list(self.requests) if request is None else [request] if request in self.requests else []
            taken = [(k, self.requests.pop(k)) for k in keys]
        errors = []
        for _, (_, futures, fd) in taken:
            try:
                for future in futures:
                    error = future.exception()
                    if error is not None and not errors:
                        errors.append(str(error))
            finally:
                os.close(fd)
        return errors

    def pending(self) -> int:
        with self.lock:
            return sum(any(not f.done() for f in futures) for _, futures, _ in self.requests.values())


def _transfer(fd: int, view: memoryview, offset: int, write: bool, path: str) -> None:
    done = 0
    while done < len(view):
        n = os.pwritev(fd, [view[done:]], offset + done) if write else os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise OSError(
                f"{path}: "
                + (
                    "pwrite wrote nothing (disk full?)"
                    if write
                    else f"short read: the file ends at byte {offset + done}, expected {offset + len(view)}"
                )
            )
        done += n
