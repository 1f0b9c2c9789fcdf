"""Where a checkpointed region's saved inputs wait for their backward: pinned host memory, or files.

[Note: offloading the checkpointed inputs] With activation checkpointing every layer keeps only
its inputs (the hidden states, ``s·b·h`` per layer); at long context they are what is left:
Llama-8B keeps 256 KB per token over its 32 layers in bf16, 128 GB at 500k tokens. Both offloads
here are ``saved_tensors_hooks`` pairs wrapped around each checkpointed call, so they see exactly
the tensors the checkpoint keeps (``torch.utils.checkpoint`` saves its inputs with
``save_for_backward``; what runs inside is recomputed, not saved).

* ``HostOffload`` (``cpu_checkpointing`` on an accelerator): each saved tensor is copied to pinned
  host memory on a side stream as it is saved, and the device copy is released once that copy is
  done. The backward unpacks in the reverse order of saving, so when one tensor is unpacked the one
  saved before it (the next the backward needs) starts its copy back on the side stream: the
  transfer overlaps the recomputation and backward of the layer in between.
* ``FileOffload`` (``offload_path``; where host memory is the limit, on the CPU too): each saved
  tensor of at least ``min_bytes`` is written to a file in the directory, flushed, and dropped from
  the page cache, so it holds no memory until read. When one is unpacked the one saved before it is
  announced to the kernel (``POSIX_FADV_WILLNEED``), which reads it ahead while this layer runs its
  backward. A file is deleted when autograd lets go of it (after the backward, or with a graph that
  is never run), so ``retain_graph`` can unpack it twice.

Which one is next is kept in a list of weak references in saving order, pruned as it goes: a
forward that never runs its backward leaves nothing behind.
"""

from __future__ import annotations

import itertools
import os
import tempfile
import weakref
from pathlib import Path
from typing import Any

import torch

from slipstream.accelerator import get_accelerator

_FADVISE = hasattr(os, "posix_fadvise")


class _Order:
    """The handles saved and not yet unpacked, oldest first (weakly held): who is next for the backward."""

    def __init__(self) -> None:
        self.saved: list[weakref.ref[Any]] = []

    def add(self, handle: Any) -> None:
        self.saved = [r for r in self.saved if r() is not None]
        self.saved.append(weakref.ref(handle))

    def taken(self, handle: Any) -> Any | None:
        """Remove ``handle``; the live one saved just before it (None when none)."""
        live = [h for h in (r() for r in self.saved) if h is not None]
        if not any(h is handle for h in live):
            return None  # unpacked a second time (retain_graph): nothing new to read ahead
        index = next(i for i, h in enumerate(live) if h is handle)
        self.saved = [weakref.ref(h) for h in live if h is not handle]
        return live[index - 1] if index > 0 else None


# --------------------------------------------------------------------------- pinned host memory


class _OnHost:
    def __init__(self, host: torch.Tensor, device: torch.device, copied: Any) -> None:
        self.host, self.device, self.copied = host, device, copied
        self.back: torch.Tensor | None = None  # the copy back, once started
        self.back_ready: Any = None


class HostOffload:
    """Saved accelerator tensors to pinned host memory and back, the next one prefetched (see the note)."""

    def __init__(self) -> None:
        self.order = _Order()
        self._stream: Any = None

    def _side(self) -> Any:
        if self._stream is None:
            self._stream = get_accelerator().new_stream()
        return self._stream

    def pack(self, tensor: torch.Tensor) -> Any:
        if tensor.device.type == "cpu":
            return tensor  # already in host memory: nothing to move
        accel, side = get_accelerator(), self._side()
        host = accel.pinned_empty(tensor.numel(), tensor.dtype).view(tensor.shape)
        side.wait_stream(accel.current_stream())  # the tensor's producer first
        with accel.stream(side):
            host.copy_(tensor, non_blocking=True)
            copied = accel.new_event()
            copied.record(side)
        tensor.record_stream(side)  # its memory is not reused before the copy has read it
        handle = _OnHost(host, tensor.device, copied)
        self.order.add(handle)
        return handle

    def _start_back(self, handle: _OnHost) -> None:
        if handle.back is not None:
            return
        accel, side = get_accelerator(), self._side()
        with accel.stream(side):
            side.wait_event(handle.copied)
            handle.back = handle.host.to(handle.device, non_blocking=True)
            handle.back_ready = accel.new_event()
            handle.back_ready.record(side)

    def unpack(self, handle: Any) -> torch.Tensor:
        if isinstance(handle, torch.Tensor):
            return handle
        accel = get_accelerator()
        self._start_back(handle)
        current = accel.current_stream()
        current.wait_event(handle.back_ready)
        tensor = handle.back
        tensor.record_stream(current)
        nxt = self.order.taken(handle)
        if nxt is not None:
            self._start_back(nxt)  # overlaps this layer's backward
        handle.back = None  # a second unpack (retain_graph) copies again rather than keep device memory
        return tensor


# --------------------------------------------------------------------------- files


class _InFile:
    def __init__(self, path: Path, shape: torch.Size, dtype: torch.dtype, device: torch.device, nbytes: int) -> None:
        self.path, self.shape, self.dtype, self.device, self.nbytes = path, shape, dtype, device, nbytes
        weakref.finalize(self, _remove, str(path))


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _advise(path: Path, advice: int) -> None:
    if not _FADVISE:
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, advice)
    finally:
        os.close(fd)


class FileOffload:
    """Saved tensors of at least ``min_bytes`` to files under ``directory`` and back (see the note)."""

    def __init__(self, directory: str | os.PathLike[str], min_bytes: int = 64 << 10) -> None:
        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        # one directory per process (ranks share the path); removed with the process's last file
        self.directory = Path(tempfile.mkdtemp(prefix=f"slipstream-activations-{os.getpid()}-", dir=root))
        weakref.finalize(self, _remove_dir, str(self.directory))
        self.min_bytes = min_bytes
        self.order = _Order()
        self._names = itertools.count()

    def pack(self, tensor: torch.Tensor) -> Any:
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0 or nbytes < self.min_bytes or tensor.layout != torch.strided:
            return tensor
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        path = self.directory / f"{next(self._names)}.bin"
        with open(path, "wb") as f:
            f.write(memoryview(data.numpy()))
            f.flush()
            os.fsync(f.fileno())  # on disk, so the page cache may drop it
            if _FADVISE:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        handle = _InFile(path, tensor.shape, tensor.dtype, tensor.device, nbytes)
        self.order.add(handle)
        return handle

    def unpack(self, handle: Any) -> torch.Tensor:
        if isinstance(handle, torch.Tensor):
            return handle
        nxt = self.order.taken(handle)
        if nxt is not None:
            _advise(nxt.path, os.POSIX_FADV_WILLNEED if _FADVISE else 0)  # read ahead while this layer runs
        raw = torch.from_file(str(handle.path), shared=False, size=handle.nbytes, dtype=torch.uint8)
        return raw.view(handle.dtype).view(handle.shape).to(handle.device)


def _remove_dir(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass  # files still referenced by a live graph: removed with them, the directory stays empty
